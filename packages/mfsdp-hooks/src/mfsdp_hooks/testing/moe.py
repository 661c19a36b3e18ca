"""A toy mixture-of-experts model for the expert-parallel tests of this layer and above.

``MoEModel``: a residual MoE block (a top-1 router and ``NUM_EXPERTS`` MLP experts) and a
linear head. With an expert-parallel (EP) group each rank keeps only its experts: tokens go to
the rank holding their expert and come back through ``all_to_all_single`` (differentiable
here). Expert parameters carry Megatron-Core's ``allreduce=False`` marking. Built with one
seed on every rank, the EP model holds exactly the one-process model's experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mfsdp_hooks.testing.parity import full_weights, inner
from mfsdp_hooks.testing.tp import ColumnParallelLinear, RowParallelLinear

__all__ = ["MOE_OUT", "MOE_WIDTH", "MoEBlock", "expert_weights", "moe_batches", "moe_model"]

MOE_WIDTH, MOE_HIDDEN, MOE_OUT, NUM_EXPERTS = 8, 12, 3, 4


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows, with the reverse exchange as its backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    out: torch.Tensor = _AllToAll.apply(x, send, recv, group)  # type: ignore[no-untyped-call]
    return out


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(MOE_WIDTH, MOE_HIDDEN)
        self.fc2 = nn.Linear(MOE_HIDDEN, MOE_WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.fc1(x)))
        return out


class MoEBlock(nn.Module):
    """A top-1 router (dense) and the experts this rank holds (all of them without EP)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(MOE_WIDTH, NUM_EXPERTS, bias=False)
        self.experts = nn.ModuleList([Expert() for _ in range(NUM_EXPERTS)])
        self.first_expert = 0
        self.ep_group: dist.ProcessGroup | None = None

    def keep_experts(self, ep_group: dist.ProcessGroup) -> None:
        """Keep only this EP rank's experts and mark their parameters as Megatron does."""
        size, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        per_rank = NUM_EXPERTS // size
        self.first_expert, self.ep_group = rank * per_rank, ep_group
        kept = self.experts[self.first_expert : self.first_expert + per_rank]
        self.experts = nn.ModuleList(list(kept))
        for param in self.experts.parameters():
            param.allreduce = False  # type: ignore[attr-defined]

    def _run_local(self, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for offset, expert in enumerate(self.experts):
            chosen = (expert_ids == self.first_expert + offset).nonzero(as_tuple=True)[0]
            # Run even on no tokens, as grouped GEMMs do: every expert gets a (zero)
            # gradient, so every rank's backward reaches the same gradient hooks.
            out = out.index_add(0, chosen, expert(x[chosen]))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x), dim=-1)
        gate, expert_ids = probs.max(dim=-1)
        if self.ep_group is None:
            return x + gate.unsqueeze(-1) * self._run_local(x, expert_ids)
        size = dist.get_world_size(self.ep_group)
        per_rank = NUM_EXPERTS // size
        order = torch.argsort(expert_ids // per_rank, stable=True)
        send = torch.bincount(expert_ids // per_rank, minlength=size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ep_group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        ids_in = torch.empty(sum(recv_sizes), dtype=expert_ids.dtype)
        dist.all_to_all_single(ids_in, expert_ids[order], recv_sizes, send_sizes, self.ep_group)
        tokens_in = _exchange(x[order], send_sizes, recv_sizes, self.ep_group)
        done = _exchange(self._run_local(tokens_in, ids_in), recv_sizes, send_sizes, self.ep_group)
        out = torch.empty_like(done).index_copy(0, order, done)
        return x + gate.unsqueeze(-1) * out


class MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MoEBlock(), MoEBlock()])
        self.head = nn.Linear(MOE_WIDTH, MOE_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def moe_model(ep_group: dist.ProcessGroup | None, etp_mesh: DeviceMesh | None = None) -> MoEModel:
    """The seeded model; with ``ep_group`` each block keeps this EP rank's experts; with
    ``etp_mesh`` (expert tensor parallelism) every expert's linears become Megatron-style
    column/row-parallel layers over it, marked ``allreduce=False`` as Megatron-Core does."""
    torch.manual_seed(0)
    model = MoEModel()
    for block in model.blocks:
        assert isinstance(block, MoEBlock)
        if ep_group is not None:
            block.keep_experts(ep_group)
        if etp_mesh is not None:
            for expert in block.experts:
                assert isinstance(expert, Expert)
                expert.fc1 = ColumnParallelLinear(expert.fc1, etp_mesh)  # type: ignore[assignment]
                expert.fc2 = RowParallelLinear(expert.fc2, etp_mesh)  # type: ignore[assignment]
            for param in block.experts.parameters():
                param.allreduce = False  # type: ignore[attr-defined]
    return model


def moe_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` global batches of 16 tokens (divisible over 1, 2 and 4 ranks)."""
    out = []
    for index in range(n):
        gen = torch.Generator().manual_seed(index)
        out.append(
            (torch.randn(16, MOE_WIDTH, generator=gen), torch.randn(16, MOE_OUT, generator=gen))
        )
    return out


def expert_weights(
    model: nn.Module, read: Callable[[nn.Module], dict[str, torch.Tensor]] = full_weights
) -> dict[str, torch.Tensor]:
    """``read(model)`` with every expert named by its global index (an EP rank holds experts
    ``first_expert...``) and the experts of the other EP ranks gathered (collective): the
    names and values of the one-process model that holds them all."""
    blocks = [m for m in inner(model).modules() if isinstance(m, MoEBlock)]
    weights = {}
    for name, value in read(model).items():
        parts = name.split(".")
        if "experts" in parts:  # blocks.B.experts.K.* holds global expert first_expert + K
            at = parts.index("experts") + 1
            block = blocks[int(parts[at - 2])]
            parts[at] = str(block.first_expert + int(parts[at]))
        weights[".".join(parts)] = value
    group = blocks[0].ep_group
    if group is not None:
        held: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(held, weights, group=group)
        for theirs in held:  # dense weights are the same on every rank: keep ours
            for name, value in theirs.items():
                weights.setdefault(name, value)
    return weights
