"""The parity matrix's ecosystem columns: the tools users bring to a sharded model.

Each column is a feature the engine does not own but must work with, checked through every
entry point against the same one-process run (``matrix_cases``):

* ``lora``: peft's LoRA on the toy model's block linears, so every unit holds frozen base
  weights beside trainable adapters (and the root unit only frozen ones).
* ``seeded_apart``: each rank builds its model with its own seed; the wrap must refuse it
  (one replica or none), naming ``check_replicas``.
* ``torch_sd_full`` / ``torch_sd_sharded``: at ``SAVE_AFTER`` the model and optimizer state
  leave through torch's ``get_model_state_dict`` / ``get_optimizer_state_dict`` (full, on
  rank 0's CPU, broadcast back from it; or sharded) and come back into a freshly built
  model (another seed) through ``set_model_state_dict`` / ``set_optimizer_state_dict``:
  the rest of training is exact only if every value, moment and step count made the trip.
* ``dcp_plain``: the same trip through plain ``dcp.save`` / ``dcp.load`` of
  ``model.state_dict()`` and the optimizer's state dict, as FSDP2 scripts write it.
* ``compile_block`` / ``compile_model``: ``torch.compile`` of each unit block after wrapping,
  or of the whole wrapped model; graphs must be compiled (counted) and training exact.
* ``adam``, ``sgd_momentum``, ``adagrad``, ``rmsprop``: the element-wise optimizers torch
  ships (AdamW is every other column's); ``muon``: torch's Muon, whose step reads whole
  matrices: handed to the engine it becomes ours (exact), built on the sharded model and
  never handed over it is refused at the first forward on every rank; ``muon_ours``:
  ``megatron_fsdp.Muon`` on the matrices with an AdamW group for the rest (against torch's
  Muon + AdamW on one process); ``ep_muon``: the same on the ``ep`` column's
  mixture-of-experts model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import megatron_fsdp
from mfsdp_hooks.testing import make_model

LR = 1e-2


def _ours_muon(params: list[Any]) -> torch.optim.Optimizer:
    """megatron_fsdp.Muon on the matrices, its AdamW group on the rest."""
    groups = [
        {"params": [q for q in params if q.ndim == 2]},
        {"params": [q for q in params if q.ndim != 2], "use_muon": False},
    ]
    return megatron_fsdp.Muon(groups, lr=LR)


MODEL_COLS = ("lora", "seeded_apart")
ROUND_TRIPS = ("torch_sd_full", "torch_sd_sharded", "dcp_plain")
_OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": lambda p: torch.optim.Adam(p, lr=LR),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=LR),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=LR),
    # Muon orthogonalises each 2-D weight's whole update: only the matrices take part.
    "muon": lambda p: torch.optim.Muon([q for q in p if q.ndim == 2], lr=LR),
    "muon_ours": _ours_muon,
    # The mixture-of-experts model, experts sharded over their own (expert data-parallel)
    # mesh: each expert's matrices are orthogonalised within that mesh's shard group.
    "ep_muon": _ours_muon,
}
COMPILED = ("compile_block", "compile_model")

COLS = (*MODEL_COLS, *ROUND_TRIPS, *_OPTIMIZERS, *COMPILED)
# Entry points whose optimizer is built on the sharded model and never handed to the engine
# (per_module, mcore) meet it at the first forward: the refusal comes there.
REFUSED_AT_FIRST_FORWARD = ("muon",)


def model(col: str, seed: int) -> nn.Module:
    """The column's model as the user builds it before wrapping."""
    if col == "seeded_apart":  # every rank its own seed: no two replicas alike
        return make_model(seed + dist.get_rank())
    import peft

    base = make_model(seed)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["fc1", "fc2"])
    torch.manual_seed(seed + 1)  # the adapters' init draws alike in every process
    return peft.get_peft_model(base, config)


class GraphCounter:
    """A ``torch.compile`` backend that counts the graphs dynamo hands it that compute a
    layer (a ``linear``: graphs of the engine's own hook calls do not count) and runs them as
    traced (``eager``: what the compiler is given is the point, not how fast it runs)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        targets = [getattr(node.target, "__name__", "") for node in gm.graph.nodes]
        self.graphs += "linear" in targets
        return gm.forward


def compiled(
    col: str, model: nn.Module, unit: type[nn.Module]
) -> tuple[nn.Module, GraphCounter | None]:
    """``compile_block``: each unit block compiled in place (``block.compile()``);
    ``compile_model``: the model the user calls, compiled whole. Returns what to call and
    the backend that counts the graphs (None for other columns)."""
    if col not in COMPILED:
        return model, None
    counter = GraphCounter()
    if col == "compile_block":
        for block in [m for m in model.modules() if isinstance(m, unit)]:
            block.compile(backend=counter)
        return model, counter
    whole: nn.Module = torch.compile(model, backend=counter)  # type: ignore[assignment]
    return whole, counter


def optimizer(col: str, params: Any) -> torch.optim.Optimizer | None:
    """The column's optimizer, or None for the matrix's AdamW."""
    build = _OPTIMIZERS.get(col)
    return None if build is None else build(list(params))


def round_trip(
    col: str, state_model: nn.Module, optim: torch.optim.Optimizer, ckpt: str
) -> Callable[[nn.Module, torch.optim.Optimizer], None]:
    """Take the state out of ``state_model``/``optim`` now; return what puts it into a
    freshly built pair (its weights drawn from another seed)."""
    if col == "dcp_plain":
        saved = {
            "model": state_model.state_dict(),
            "optim": get_optimizer_state_dict(state_model, optim),
        }
        dcp.save(saved, checkpoint_id=ckpt)

        def load_dcp(fresh: nn.Module, fresh_optim: torch.optim.Optimizer) -> None:
            into = {
                "model": fresh.state_dict(),
                "optim": get_optimizer_state_dict(fresh, fresh_optim),
            }
            dcp.load(into, checkpoint_id=ckpt)
            fresh.load_state_dict(into["model"])
            set_optimizer_state_dict(fresh, fresh_optim, into["optim"])

        return load_dcp
    full = col == "torch_sd_full"
    out = StateDictOptions(full_state_dict=full, cpu_offload=full)
    model_sd = get_model_state_dict(state_model, options=out)
    optim_sd = get_optimizer_state_dict(state_model, optim, options=out)
    positional = [k for k in optim_sd.get("state", {}) if not isinstance(k, str)]
    assert not positional, f"optimizer state keyed by {positional[:3]}, not by name as FSDP2's"

    def load(fresh: nn.Module, fresh_optim: torch.optim.Optimizer) -> None:
        # Full and offloaded: only rank 0 holds it, and sends it to the others (torchtitan's
        # way of loading a full checkpoint).
        into = StateDictOptions(full_state_dict=full, broadcast_from_rank0=full)
        set_model_state_dict(fresh, model_sd, options=into)
        set_optimizer_state_dict(fresh, fresh_optim, optim_sd, options=into)

    return load
