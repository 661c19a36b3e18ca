"""A parameter no rank's backward reached keeps ``.grad`` None, as under DDP and FSDP2.

Issue 49 item 3 (torch's ``test_double_partial_forward_then_backward``): a unit that ran
forward but whose output, or one of whose parameters, did not reach the loss got a reduced
zero gradient where DDP and FSDP2 give None; AdamW then moved it by weight decay and
momentum, so training silently differed. A parameter that got a gradient on some rank only
still gets the reduced gradient (zeros from the others), as DDP gives it.

One 2-rank world trains, side by side on the same batches, our per-module ``fully_shard``,
the seed API (``FSDPRootWrapper`` + ``attach_optimizer``, whose contiguous step must skip what
has no gradient), torch's FSDP2 and DDP (``find_unused_parameters=True``) with AdamW.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from hooks_models import OptionalBranch
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp_collectives.testing import run_distributed

STEPS = 10


class Net(nn.Module):
    """Two branches, and ``aux``: a unit that always runs but reaches the loss only when used."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([OptionalBranch(), OptionalBranch()])
        self.aux = OptionalBranch()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use: tuple[bool, bool]) -> torch.Tensor:
        use_side, use_aux = use
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, use_side)
        extra = self.aux(h, use_side)
        return self.head(h + extra if use_aux else h)


def _used(step: int, rank: int, mixed: bool) -> tuple[bool, bool]:
    """(``side``, ``aux``) used: every third step by no rank; ``mixed``: the step after, the
    branches' ``side`` by rank 0 alone (``aux`` by both: a unit whose output reaches the loss
    on one rank only ends its backward at different points, which ``test_hooks_unused_params``
    leaves out too)."""
    if step % 3 == 1:
        return False, False
    if mixed and step % 3 == 2:
        return rank == 0, True
    return True, True


def _build(impl: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model: nn.Module = Net()
    if impl == "ddp":
        model = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    elif impl == "seed":
        from mfsdp_hooks import FSDPRootWrapper, ShardingOptions, attach_optimizer

        options = ShardingOptions(sync_model_each_microbatch=False)
        model = FSDPRootWrapper(model, fsdp_unit_modules=[OptionalBranch], options=options)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        return model, attach_optimizer(optimizer)
    else:
        if impl == "fsdp2":
            from torch.distributed.fsdp import fully_shard
        else:
            from mfsdp_hooks import fully_shard
        for block in (*model.blocks, model.aux):  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(rank: int, impl: str, mixed: bool) -> dict[str, Any]:
    model, optimizer = _build(impl)
    losses, absent = [], []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)
        loss = (model(x, _used(step, rank, mixed)) - y).pow(2).mean()
        loss.backward()
        absent.append([i for i, p in enumerate(model.parameters()) if p.grad is None])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = [
        (p.full_tensor() if isinstance(p, DTensor) else p.detach()).tolist()
        for p in model.parameters()
    ]
    return {"losses": losses, "absent": absent, "weights": weights}


def _worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    runs = {impl: _train(rank, impl, mixed=False) for impl in ("ours", "seed", "fsdp2", "ddp")}
    # FSDP2 decides each rank's reduction from its own gradients: ranks that disagree would
    # pair mismatched reduce-scatters, so only DDP is the reference there.
    runs.update({f"{impl}-mixed": _train(rank, impl, mixed=True) for impl in ("ours", "ddp")})
    dist.barrier()
    return runs


def _assert_same(ours: dict[str, Any], theirs: dict[str, Any], what: str) -> None:
    assert ours["absent"] == theirs["absent"], what
    for step, (a, b) in enumerate(zip(ours["losses"], theirs["losses"], strict=True)):
        assert abs(a - b) <= 1e-5, (what, step, a, b)
    for index, (a, b) in enumerate(zip(ours["weights"], theirs["weights"], strict=True)):
        diff = (torch.tensor(a) - torch.tensor(b)).abs().max().item()
        assert diff <= 1e-5, (what, index, diff)


def test_a_parameter_no_rank_reached_keeps_grad_none_as_fsdp2_and_ddp() -> None:
    for rank, runs in enumerate(run_distributed(_worker, 2, timeout=120)):
        unused = runs["fsdp2"]["absent"][1]
        # side of each branch (4 tensors) and all of aux (4): the scenario holds
        assert len(unused) == 8 and runs["ddp"]["absent"][1] == unused, rank
        assert runs["ours"]["absent"][1] == unused, f"ours gave reduced zeros on rank {rank}"
        for impl in ("ours", "seed", "ddp"):
            _assert_same(runs[impl], runs["fsdp2"], f"{impl} vs fsdp2 on rank {rank}")
        # rank 0 alone used them: every rank takes the reduced gradient, none is None
        assert runs["ddp-mixed"]["absent"][2] == [], rank
        _assert_same(runs["ours-mixed"], runs["ddp-mixed"], f"mixed, rank {rank}")
