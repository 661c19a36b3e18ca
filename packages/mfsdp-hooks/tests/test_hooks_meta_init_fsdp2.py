"""FSDP2's meta-init contract through the per-module ``fully_shard`` (torchtitan's recipe):
build on meta, shard each block and the root, ``model.to_empty(device=...)``, then the
model's own ``init_weights()``. Nothing is initialised by the wrap (no ``reset_parameters``:
the norms below have none), so the user's init draws the same numbers as under FSDP2."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import fully_shard

DIM, VOCAB, STEPS = 16, 32, 10


class RMSNorm(nn.Module):
    """No ``reset_parameters``, as torchtitan's and Hugging Face's norms."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))

    def init_weights(self) -> None:
        nn.init.ones_(self.norm.weight)
        for linear in (self.up, self.down):
            nn.init.trunc_normal_(linear.weight, std=0.2)
            nn.init.zeros_(linear.bias)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        # Recomputed by init_weights, as torchtitan's rotary table (freqs_cis).
        self.register_buffer("position_scale", torch.empty(DIM), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * self.position_scale
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # type: ignore[no-any-return]

    def init_weights(self) -> None:
        self.position_scale = 1.0 + torch.arange(DIM, dtype=torch.float32) / DIM
        nn.init.normal_(self.embed.weight)
        for block in self.blocks:
            block.init_weights()  # type: ignore[operator]
        nn.init.ones_(self.norm.weight)
        nn.init.trunc_normal_(self.head.weight, std=0.2)


def _sharded_on_meta(impl: str) -> Tiny:
    shard = fully_shard if impl == "ours" else torch_fully_shard
    with torch.device("meta"):
        model = Tiny()
    for block in model.blocks:
        shard(block)
    shard(model)
    return model


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _train_worker(rank: int, world: int, impl: str) -> tuple[bool, list[tuple[float, float]]]:
    """Whether the wrap drew random numbers, and the losses of 10 AdamW steps (each rank's
    half of the batch) from the weights the model's own init wrote after ``to_empty``; the
    one-process reference starts from those same weights (DTensor random ops on a CPU mesh
    draw per local piece, and our pieces are cut otherwise than FSDP2's)."""
    rng = torch.get_rng_state()
    model = _sharded_on_meta(impl)
    wrap_drew = not torch.equal(rng, torch.get_rng_state())
    assert model.position_scale.is_meta  # buffers wait for to_empty, as with FSDP2
    model.to_empty(device="cpu")
    torch.manual_seed(7)  # the same on every rank, as torchtitan seeds before init
    with torch.no_grad():
        model.init_weights()
    reference = Tiny()
    with torch.no_grad():
        reference.init_weights()  # for its buffer: the weights are then ours
    reference.load_state_dict(_full(model))
    losses: list[tuple[float, float]] = []  # (mean over the ranks, one process)
    optimizers = [
        torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, reference)
    ]
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step)
        tokens = torch.randint(0, VOCAB, (4, 6), generator=gen)
        ours = _step(model, optimizers[0], tokens.chunk(world)[rank]).detach().clone()
        dist.all_reduce(ours)
        losses.append((ours.item() / world, _step(reference, optimizers[1], tokens).item()))
    return wrap_drew, losses


def test_to_empty_then_init_weights_trains_as_one_process_and_the_wrap_draws_nothing() -> None:
    """Failed before: fully_shard refused RMSNorm ('define no reset_parameters()'); given
    one, the wrap drew it, so the user's init drew other numbers than under FSDP2."""
    for impl in ("ours", "fsdp2"):
        for wrap_drew, losses in run_distributed(_train_worker, 2, impl, timeout=120):
            assert not wrap_drew, impl
            sharded, one_process = zip(*losses, strict=True)
            torch.testing.assert_close(sharded, one_process, rtol=1e-5, atol=0)


def _before_to_empty_worker(rank: int, world: int) -> list[str]:
    model = _sharded_on_meta("ours")
    messages = []
    tokens = torch.zeros(2, 3, dtype=torch.long)
    for attempt in (lambda: model(tokens), lambda: model.to("cpu"), lambda: model.float()):
        try:
            attempt()
        except (RuntimeError, NotImplementedError) as error:
            messages.append(str(error))
        else:
            messages.append("no error")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    model(tokens).sum().backward()  # runs once storage was given
    return messages


def test_forward_or_a_copy_before_to_empty_is_refused_naming_it() -> None:
    """A forward on the zeros the wrap left (FSDP2's would fail on meta tensors), and the
    conversions FSDP2's meta parameters cannot take either, name ``to_empty``."""
    for messages in run_distributed(_before_to_empty_worker, 2, timeout=60):
        assert len(messages) == 3
        for message in messages:
            assert "meta device" in message and "to_empty(device=" in message, message
