"""The engine on a CUDA device with NCCL and real side streams (skipped without one).

World 1 is what one lent GPU gives: the collectives are NCCL's, the all-gathers and
reductions run on the side streams with their events, and training must equal training the
same model on the same device without FSDP, step for step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hooks_models import (
    Block,
    assert_close_rel,
    full_state,
    loss_fn,
    make_batches,
    make_model,
    make_optimizer,
    trainable,
)

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import FSDPRootWrapper, ShardingOptions, fsdp_units

pytestmark = pytest.mark.cuda

STEPS = 10


def _cuda_parity_worker(rank: int, world: int, strategy: int) -> dict[str, float]:
    device = torch.device("cuda", torch.cuda.current_device())
    batches = [(t.to(device), y.to(device)) for t, y in make_batches(STEPS, 8)]
    reference = make_model().to(device)
    ref_opt = make_optimizer("adamw", trainable(reference))
    model = FSDPRootWrapper(
        make_model().to(device),
        fsdp_unit_modules=[Block],
        options=ShardingOptions(zero_dp_strategy=strategy, sync_model_each_microbatch=False),
    )
    root = fsdp_units(model.module)[0]
    optimizer = make_optimizer("adamw", trainable(model))
    torch.cuda.reset_peak_memory_stats(device)
    for step, (tokens, targets) in enumerate(batches):
        want = loss_fn(reference(tokens), targets)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        got = loss_fn(model(tokens), targets)
        got.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert_close_rel(got.detach(), want.detach(), 1e-5, f"strategy {strategy} step {step}")
    assert root.root is not None and root.root.streams.active, "side streams were not used"
    state = full_state(model.module)
    for name, value in reference.state_dict().items():
        assert_close_rel(state[name], value, 1e-5, f"strategy {strategy} {name}")
    torch.cuda.synchronize(device)
    return {"peak_mib": torch.cuda.max_memory_allocated(device) / 2**20}


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_parity_on_cuda_with_nccl_and_side_streams(strategy: int) -> None:
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs a CUDA device and NCCL: the side-stream path only runs there")
    results = run_distributed(_cuda_parity_worker, 1, strategy, backend="nccl", timeout=180)
    assert results[0]["peak_mib"] > 0
