"""The engine on a CUDA device with NCCL and real side streams (skipped without one).

World 1 is what one lent GPU gives: the collectives are NCCL's, the all-gathers and
reductions run on the side streams with their events, and training must equal training the
same model on the same device without FSDP, step for step.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from hooks_models import Block, full_state, make_batches, make_model, make_optimizer
from torch import nn

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import FSDPRootWrapper, ShardingOptions, fsdp_units
from mfsdp_hooks.testing.parity import ParityCase, check_parity, inner

pytestmark = pytest.mark.cuda


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _cuda_model() -> nn.Module:
    return make_model().to(_device())


def _cuda_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(t.to(_device()), y.to(_device())) for t, y in make_batches(n, 8)]


def _root_wrapper(model: nn.Module, strategy: int) -> nn.Module:
    options = ShardingOptions(zero_dp_strategy=strategy, sync_model_each_microbatch=False)
    return FSDPRootWrapper(model, fsdp_unit_modules=[Block], options=options)


def _cuda_parity_worker(rank: int, world: int, strategy: int) -> dict[str, float]:
    case = ParityCase(
        f"cuda strategy {strategy}",
        partial(_root_wrapper, strategy=strategy),
        model=_cuda_model,
        optimizer=partial(make_optimizer, "adamw"),
        batches=_cuda_batches,
        weights=full_state,
    )
    torch.cuda.reset_peak_memory_stats(_device())
    model = check_parity(rank, world, case)
    root = fsdp_units(inner(model))[0]
    assert root.root is not None and root.root.streams.active, "side streams were not used"
    torch.cuda.synchronize(_device())
    return {"peak_mib": torch.cuda.max_memory_allocated(_device()) / 2**20}


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_parity_on_cuda_with_nccl_and_side_streams(strategy: int) -> None:
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs a CUDA device and NCCL: the side-stream path only runs there")
    results = run_distributed(_cuda_parity_worker, 1, strategy, backend="nccl", timeout=180)
    assert results[0]["peak_mib"] > 0
