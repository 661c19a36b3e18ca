"""``DistributedDataParallelConfig(fp8_param_gather=True)`` on torchao float8: the class API
and the Megatron-Core adapter convert the model's eligible Linear layers (both dims multiples
of 16) to ``Float8Linear`` with float8 all-gather weights before sharding.

Checked at 2 and 4 ranks: every converted weight is gathered as one byte per element
(``describe``: gather dtype uint8, the rest fp32), and training matches the same conversion
trained in one process (each rank's share replayed as a micro-batch of its own: float8
scales activations per tensor) to 1e-5 over 10 steps. A model with nothing to convert, or
converted without float8 all-gather, is refused naming the field.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

pytest.importorskip("torchao.float8", reason="torchao is not installed (nox installs it)")

from mcore_stand_ins import MCoreDDPConfigStandIn, TransformerConfigStandIn

from megatron_fsdp import DistributedDataParallelConfig, FSDPDistributedIndex, MegatronFSDP
from megatron_fsdp.mcore import FullyShardedDataParallel
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import describe
from mfsdp_hooks.testing import assert_close_rel
from mfsdp_te import convert_for_float8_param_gather
from mfsdp_te.float8_testing import Float8Block, Float8Model, float8_step

STEPS = 10
FULL = os.environ.get("MFSDP_FULL_MATRIX") == "1"
LINEAR_WEIGHTS = ("blocks.0.up.weight", "blocks.0.down.weight", "head.weight")


def _plain_model() -> Float8Model:
    """The float8 test model before any conversion (what a user's config-driven run has)."""
    torch.manual_seed(0)
    return Float8Model()


def _wrap(entry: str, model: nn.Module, world: int) -> nn.Module:
    if entry == "class":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        config = DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params", fp8_param_gather=True
        )
        index = FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard")
        return MegatronFSDP(model, index, config, fsdp_unit_modules=[Float8Block])
    ddp_config = MCoreDDPConfigStandIn(
        data_parallel_sharding_strategy="optim_grads_params",
        use_distributed_optimizer=True,
        use_megatron_fsdp=True,
        fp8_param_gather=True,
    )
    return FullyShardedDataParallel(
        TransformerConfigStandIn(), ddp_config, model, fsdp_unit_modules=[Float8Block]
    )


def _fp8_worker(rank: int, world: int, entry: str) -> dict[str, Any]:
    model = _wrap(entry, _plain_model(), world)
    gathered = {}
    for group in describe(model).groups:
        for name in group.params:
            full = f"{group.unit}.{name}" if group.unit else name
            gathered[full.split("module.")[-1]] = group.gather_dtype
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        if entry == "mcore":
            model.zero_grad_buffer()  # type: ignore[operator]
        losses.append(float8_step(model, optimizer, step, world, sharded=True))
    weights = {
        name.split("module.")[-1]: p.full_tensor().tolist() for name, p in model.named_parameters()
    }
    return {"losses": losses, "weights": weights, "gathered": gathered}


def _cases() -> list[Any]:
    cases = []
    for entry in ("class", "mcore"):
        for world in (2, 4):
            skip = (world, entry) != (2, "class") and not FULL
            marks = [pytest.mark.skip(reason="full matrix only: MFSDP_FULL_MATRIX=1")] * skip
            cases.append(pytest.param(entry, world, marks=marks))
    return cases


@pytest.mark.parametrize(("entry", "world"), _cases())
def test_fp8_param_gather_converts_gathers_float8_and_trains_at_parity(
    entry: str, world: int
) -> None:
    results = run_distributed(_fp8_worker, world, entry, timeout=300)
    reference = _plain_model()
    converted = convert_for_float8_param_gather(reference, "fp8_param_gather")
    assert converted == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "head"]
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    want = [float8_step(reference, optimizer, step, world, sharded=False) for step in range(STEPS)]
    for rank, result in enumerate(results):
        gathered = result["gathered"]
        for name in LINEAR_WEIGHTS:
            assert gathered[name] == torch.uint8, (name, gathered)  # one byte per element
        assert gathered["blocks.0.norm.weight"] == torch.float32, gathered
        for step, (got, exp) in enumerate(zip(result["losses"], want, strict=True)):
            assert abs(got - exp) <= 1e-5 * abs(exp), (rank, step, result["losses"], want)
        for name, param in reference.named_parameters():
            got_w = torch.tensor(result["weights"][name])
            assert_close_rel(got_w, param.detach().float(), 1e-5, f"rank {rank} {name}")


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(10, 6)  # not multiples of 16: float8 matmuls cannot take it


def test_fp8_param_gather_refuses_what_it_cannot_gather_in_float8() -> None:
    with pytest.raises(ValueError, match=r"fp8_param_gather=True.*multiples of 16"):
        convert_for_float8_param_gather(_Small(), "ddp_config.fp8_param_gather")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = _plain_model()
    convert_to_float8_training(model, config=Float8LinearConfig())  # no float8 all-gather
    with pytest.raises(ValueError, match=r"'blocks.0.up'.*enable_fsdp_float8_all_gather=True"):
        convert_for_float8_param_gather(model, "ddp_config.fp8_param_gather")


def test_an_already_converted_model_is_kept_as_it_is() -> None:
    model = _plain_model()
    first = convert_for_float8_param_gather(model, "fp8_param_gather")
    layers = [model.get_submodule(name) for name in first]
    assert convert_for_float8_param_gather(model, "fp8_param_gather") == first
    assert [model.get_submodule(name) for name in first] == layers  # the same modules
