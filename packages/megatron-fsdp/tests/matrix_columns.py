"""The parity matrix's rows and columns, what each column runs on, and its data.

A column's model family, world size, ZeRO strategy and micro-batches; each step's global
batch, the eval batch and the loss. See ``matrix_cases`` for the rows and families.
"""

from __future__ import annotations

from typing import Any

import ecosystem_cases
import torch
from torch import nn

from megatron_fsdp import MixedPrecisionPolicy
from mfsdp_hooks.testing import Block, loss_fn, make_batches
from mfsdp_hooks.testing.moe import MOE_OUT, MOE_WIDTH, MoEBlock
from mfsdp_hooks.testing.tp import TP_OUT, TP_WIDTH, MLPBlock

ROWS = ("seed", "model_optimizer", "class", "per_module", "mcore")
COLS = (
    "zero0",
    "zero1",
    "zero2",
    "zero3",
    "hsdp",
    "hfsdp",
    "hfsdp_tp",
    "tp_dtensor",
    "tp_megatron",
    "ep",
    "cp",
    "meta_init",
    "float8",
    "bf16",
    "no_sync",
    "recompute",
    "cpu_offload",
    "tied",
    "frozen",
    "dcp_resume",
    "to_device",
    "train_eval",
    "decoupled_grad",
    "fine_grained",
    "reshard_int",
    "comm_hooks",
    *ecosystem_cases.COLS,
)

STEPS = 10
SAVE_AFTER = 5  # dcp_resume: save after this many steps, resume a fresh model for the rest
LR = 1e-2
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

_FAMILY = {
    "tp_dtensor": "tp",
    "tp_megatron": "tp",
    "hfsdp_tp": "tp",
    "ep": "ep",
    "ep_muon": "ep",
    "float8": "float8",
}
_WORLD = {
    "hsdp": 4,
    "hfsdp": 4,
    "hfsdp_tp": 4,
    "tp_dtensor": 4,
    "tp_megatron": 4,
    "ep": 4,
    "ep_muon": 4,
    "cp": 4,
    "reshard_int": 4,
}
_STRATEGY = {"zero0": 0, "zero1": 1, "zero2": 2}
STRATEGY_NAME = {0: "no_shard", 1: "optim", 2: "optim_grads", 3: "optim_grads_params"}
_UNIT: dict[str, type[nn.Module]] = {"toy": Block, "tp": MLPBlock, "ep": MoEBlock}


def family(col: str) -> str:
    return _FAMILY.get(col, "toy")


def world_size(col: str) -> int:
    """Ranks a column needs: 4 for 2x2 meshes, 2 otherwise."""
    return _WORLD.get(col, 2)


def strategy(col: str) -> int:
    """The ZeRO strategy of a column (ZeRO-3 unless the column is about the strategy)."""
    return _STRATEGY.get(col, 3)


def micro_batches(col: str) -> int:
    return 2 if col == "no_sync" else 1


def unit_class(col: str) -> type[nn.Module]:
    if family(col) == "float8":
        from mfsdp_te.float8_testing import Float8Block

        return Float8Block
    return _UNIT[family(col)]


# --------------------------------------------------------------------------- data
def global_batch(col: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole batch (what one process trains on)."""
    kind = family(col)
    if kind == "toy":
        # cp cuts the sequence over 2 ranks: 6 positions (the default 5 would not divide).
        return _toy_batches(6 if col == "cp" else 5)[step]
    gen = torch.Generator().manual_seed(step)
    if kind == "tp":
        return torch.randn(8, 4, TP_WIDTH, generator=gen), torch.randn(8, 4, TP_OUT, generator=gen)
    if kind == "ep":
        return torch.randn(16, MOE_WIDTH, generator=gen), torch.randn(16, MOE_OUT, generator=gen)
    from mfsdp_te.float8_testing import float8_batch

    return float8_batch(step)


_BATCHES: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def _toy_batches(seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if seq not in _BATCHES:
        _BATCHES[seq] = make_batches(STEPS, global_batch=12, seq=seq)
    return _BATCHES[seq]


def eval_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """train_eval: the batch evaluated under ``no_grad`` after every step."""
    return make_batches(1, global_batch=12, seq=5, seed=99)[0]


def batch_loss(col: str, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    if family(col) == "toy":
        return loss_fn(outputs, targets)
    return nn.functional.mse_loss(outputs, targets)


def shares_in_reference(col: str) -> int:
    """How many per-rank shares the one-process reference runs as micro-batches of their
    own: float8 scales activations per tensor and bf16 rounds each share's gradient before
    the fp32 reduction, so the reference must see what each rank computes."""
    return world_size(col) if col in ("float8", "bf16") else 1
