"""``model.to(torch.float64)`` / ``.double()`` / ``.to(torch.bfloat16)`` after the per-module
``fully_shard`` converts the sharded parameters, as FSDP2's do (torch's
``test_to_float64_after_init``): each rank converts its own shards into new flat buffers, the
parameter objects keep their identity (an optimizer built before the conversion steps them),
and training goes on in the new dtype. An optimizer that already holds state for them is
refused, as is a change of device."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy
from torch.distributed.tensor import DTensor

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing.parity import shard_blocks

DIM, VOCAB, STEPS = 16, 32, 10


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 3 * DIM)
        self.down = nn.Linear(3 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.relu(self.up(self.norm(x))))
        return out


class Tiny(nn.Module):
    """Token inputs: no input cast needed, whatever dtype the weights are in."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # type: ignore[no-any-return]


def _model() -> Tiny:
    torch.manual_seed(0)  # the same weights on every rank
    return Tiny()


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(100 + step))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    logits = model(tokens).reshape(-1, VOCAB).float()
    loss = nn.functional.cross_entropy(logits, tokens.reshape(-1))
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param


def _float64_worker(rank: int, world: int, convert: str) -> None:
    reference = _model().double()
    model = shard_blocks(_model(), "ours")
    params = list(model.parameters())
    optimizer = _adamw(params)  # built before the conversion: still steps the parameters
    if convert == "double":
        model.double()
    else:
        model.to(torch.float64)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    for param in params:
        assert isinstance(param, DTensor)
        assert param.dtype == param.to_local().dtype == torch.float64
        assert param._spec.tensor_meta is not None
        assert param._spec.tensor_meta.dtype == torch.float64
    ref_optimizer = _adamw(reference.parameters())
    for step in range(STEPS):
        tokens = _tokens(step)
        _step(model, optimizer, tokens.chunk(world)[rank])
        _step(reference, ref_optimizer, tokens)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert param.grad is None
        for key in ("exp_avg", "exp_avg_sq"):
            assert optimizer.state[param][key].dtype == torch.float64, (name, key)
        torch.testing.assert_close(_full(param), ref, rtol=0, atol=1e-10, msg=name)


def _float64_both_worker(rank: int, world: int) -> None:
    for convert in ("to", "double"):
        _float64_worker(rank, world, convert)


def test_to_float64_after_sharding_trains_as_one_float64_process() -> None:
    """Failed before: NotImplementedError ('converting a fully-sharded model's parameters
    from torch.float32 on cpu to torch.float64 on cpu ... is not supported')."""
    run_distributed(_float64_both_worker, 2, timeout=120)


def _both_converted_worker(rank: int, world: int, dtype: torch.dtype, bf16: bool) -> Any:
    return [_converted_worker(rank, world, impl, dtype, bf16) for impl in ("ours", "fsdp2")]


def _converted_worker(rank: int, world: int, impl: str, dtype: torch.dtype, bf16: bool) -> Any:
    """Losses (mean over the ranks) of 10 AdamW steps after ``.to(dtype)`` of a sharded fp32
    model (computing in bf16 through the policy when ``bf16``), and the parameters' dtype."""
    options: dict[str, Any] = {}
    if bf16:
        options["mp_policy"] = FSDP2Policy(param_dtype=torch.bfloat16)
    model = shard_blocks(_model(), impl, **options)
    model.to(dtype)
    optimizer = _adamw(model.parameters())
    losses = []
    for step in range(STEPS):
        loss = torch.tensor(_step(model, optimizer, _tokens(step).chunk(world)[rank]))
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses, {p.dtype for p in model.parameters()}


@pytest.mark.parametrize(
    ("dtype", "bf16"),
    [(torch.bfloat16, False), (torch.float64, True)],
    ids=["pure_bf16", "float64_weights_bf16_compute"],
)
def test_conversion_after_sharding_trains_as_fsdp2(dtype: torch.dtype, bf16: bool) -> None:
    """``.to(torch.bfloat16)``: pure-bf16 training; ``.to(torch.float64)`` under a policy of
    ``param_dtype=bfloat16``: float64 sharded weights (and gradients, optimizer state), bf16
    compute, as FSDP2 (its policy's param_dtype is kept, the original dtype follows)."""
    ours, fsdp2 = run_distributed(_both_converted_worker, 2, dtype, bf16, timeout=120)[0]
    assert ours[1] == fsdp2[1] == {dtype}
    torch.testing.assert_close(ours[0], fsdp2[0], rtol=1e-5, atol=0)
    assert ours[0][-1] < ours[0][0]


def _refused_worker(rank: int, world: int) -> list[str]:
    model = shard_blocks(_model(), "ours")
    optimizer = _adamw(model.parameters())
    _step(model, optimizer, _tokens(0).chunk(world)[rank])
    before = {name: _full(p).clone() for name, p in model.named_parameters()}
    messages = []
    for attempt in (model.double, lambda: model.to("meta")):
        with pytest.raises(NotImplementedError) as error:
            attempt()
        messages.append(str(error.value))
    for name, param in model.named_parameters():  # nothing moved
        assert param.dtype == torch.float32
        torch.testing.assert_close(_full(param), before[name], rtol=0, atol=0)
    _step(model, optimizer, _tokens(1).chunk(world)[rank])
    return messages


def test_conversion_with_optimizer_state_or_to_another_device_is_refused() -> None:
    """Adam's float32 state cannot step float64 parameters: refused naming the fix, on every
    rank, before anything changed; a change of device stays refused."""
    for state, device in run_distributed(_refused_worker, 2, timeout=120):
        assert "AdamW" in state and "holds state" in state and "before" in state, state
        assert "meta" in device and "Convert the model before sharding" in device, device


def _wrapper_worker(rank: int, world: int) -> list[float]:
    """The root wrapper (the seed API's engine) under ZeRO-0..2, on the toy model with a tied
    and a frozen weight: the largest deviation from one float64 process after 3 steps."""
    from mfsdp_hooks import FSDPRootWrapper, ShardingOptions
    from mfsdp_hooks.testing import (
        Block as ToyBlock,
    )
    from mfsdp_hooks.testing import (
        make_batches,
        make_model,
        train_data_parallel,
        train_single_process,
    )

    errors = []
    for strategy in (0, 1, 2):
        reference = make_model().double()
        options = ShardingOptions(zero_dp_strategy=strategy, sync_model_each_microbatch=False)
        model = FSDPRootWrapper(make_model(), fsdp_unit_modules=[ToyBlock], options=options)
        optimizer = _adamw(model.parameters())
        model.double()
        train_data_parallel(model, optimizer, make_batches(3), rank, world)
        train_single_process(reference, _adamw(reference.parameters()), make_batches(3))
        pairs = zip(model.parameters(), reference.parameters(), strict=True)
        errors.append(max((_full(p) - ref).abs().max().item() for p, ref in pairs))
        assert {p.dtype for p in model.parameters()} == {torch.float64}
    return errors


def test_to_float64_through_the_root_wrapper_every_strategy() -> None:
    for errors in run_distributed(_wrapper_worker, 2, timeout=120):
        assert max(errors) <= 1e-10, errors
