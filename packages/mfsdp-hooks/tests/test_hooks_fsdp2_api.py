"""FSDP2's ``fully_shard`` options, side by side with torch's FSDP2 on the same CPU ranks.

``ignored_params`` are left alone by both (not sharded, gradients not reduced: each rank
trains them on its own batch); the losses, the ignored parameters' values and the
``state_dict`` keys and shapes agree. Options the engine does not have yet raise naming them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hooks_models import local_slice, make_batches, make_model, train_data_parallel
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import fully_shard

STEPS = 5


def _shard(model: nn.Module, impl: str, **options: Any) -> None:
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        shard: Any = torch_fully_shard
    else:
        shard = fully_shard
    for block in model.blocks:  # type: ignore[union-attr]
        shard(block, **options)
    shard(model, **options)


def _ignored_worker(rank: int, world: int, impl: str) -> dict[str, Any]:
    model = make_model()
    ignored = {model.blocks[0].fc1.weight, model.blocks[1].norm.bias}  # type: ignore[index]
    _shard(model, impl, ignored_params=ignored)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = train_data_parallel(model, optimizer, make_batches(STEPS), rank, world)
    state = model.state_dict()
    return {
        "losses": losses,
        "ignored": [p.detach().tolist() for p in sorted(ignored, key=lambda p: p.numel())],
        "ignored_are_plain": all(type(p) is nn.Parameter for p in ignored),
        "keys": {k: tuple(v.shape) for k, v in state.items()},
    }


def test_ignored_params_are_left_alone_as_fsdp2_leaves_them() -> None:
    ours = run_distributed(_ignored_worker, 2, "ours", timeout=120)
    torch_fsdp2 = run_distributed(_ignored_worker, 2, "fsdp2", timeout=120)
    for mine, theirs in zip(ours, torch_fsdp2, strict=True):
        assert mine["ignored_are_plain"] and theirs["ignored_are_plain"]
        for a, b in zip(mine["losses"], theirs["losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (mine["losses"], theirs["losses"])
        for a, b in zip(mine["ignored"], theirs["ignored"], strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)
        assert mine["keys"] == theirs["keys"]
    # Not reduced: each rank trained the ignored parameters on its own batch.
    assert ours[0]["ignored"][1] != ours[1]["ignored"][1]


def _policy_worker(rank: int, world: int, impl: str) -> list[float]:
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy

    model = make_model()
    _shard(model, impl, mp_policy=FSDP2Policy(param_dtype=torch.bfloat16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    tokens, _ = make_batches(1)[0]
    assert model(local_slice(tokens, rank, world))[0].dtype == torch.bfloat16  # the policy's
    return train_data_parallel(model, optimizer, make_batches(STEPS), rank, world)


def test_torch_fsdp2_mixed_precision_policy_is_taken_as_it_is() -> None:
    ours = run_distributed(_policy_worker, 2, "ours", timeout=120)
    torch_fsdp2 = run_distributed(_policy_worker, 2, "fsdp2", timeout=120)
    for mine, theirs in zip(ours, torch_fsdp2, strict=True):
        for a, b in zip(mine, theirs, strict=True):  # bf16 compute: bf16 tolerance
            assert abs(a - b) <= 1e-2 * abs(b), (mine, theirs)


def _option_worker(rank: int, world: int, option: str) -> str:
    model = make_model()
    if option == "modules":
        try:
            fully_shard([model.blocks[0], model.blocks[1]])  # type: ignore[arg-type, index]
        except NotImplementedError as error:
            return f"{type(error).__name__}: {error}"
        return "accepted"
    options: dict[str, Any] = {
        "reshard_after_forward": {"reshard_after_forward": 2},
        "ignored_params": {"ignored_params": ["fc1.weight"]},
        "offload_policy": {"offload_policy": object()},
    }[option]
    try:
        fully_shard(model, **options)
    except (NotImplementedError, ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("reshard_after_forward", "NotImplementedError: reshard_after_forward=2"),
        ("ignored_params", "TypeError: ignored_params[0] is a str, not a parameter"),
        ("offload_policy", "TypeError: fully_shard() got unsupported argument(s) offload_policy"),
        ("modules", "NotImplementedError: fully_shard([module, ...]): one unit over several"),
    ],
)
def test_options_the_engine_lacks_raise_naming_them(option: str, expected: str) -> None:
    for message in run_distributed(_option_worker, 2, option, timeout=60):
        assert message.startswith(expected), message


class _Scorer(nn.Module):
    """``score`` reads the weight without going through ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x)
        return out

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.lin.weight.t()).sum(dim=-1)


def _forward_method_worker(rank: int, world: int, impl: str) -> dict[str, Any]:
    from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

    from mfsdp_hooks import register_fsdp_forward_method

    torch.manual_seed(0)
    model = nn.Sequential(_Scorer(), nn.Linear(8, 4))
    x = torch.randn(3, 8)
    want = model[0].score(x).tolist()
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        torch_fully_shard(model[0])
        torch_fully_shard(model)
        torch_register(model[0], "score")
    else:
        fully_shard(model[0])
        fully_shard(model)
        register_fsdp_forward_method(model[0], "score")
    model(x)  # the root's first forward sets the units up
    got = model[0].score(x).tolist()
    return {"got": got, "want": want, "resharded": isinstance(model[0].lin.weight, DTensor)}


def test_a_registered_forward_method_sees_the_whole_weights_as_in_fsdp2() -> None:
    ours = run_distributed(_forward_method_worker, 2, "ours", timeout=120)
    torch_fsdp2 = run_distributed(_forward_method_worker, 2, "fsdp2", timeout=120)
    for mine, theirs in zip(ours, torch_fsdp2, strict=True):
        torch.testing.assert_close(torch.tensor(mine["got"]), torch.tensor(mine["want"]))
        torch.testing.assert_close(torch.tensor(mine["got"]), torch.tensor(theirs["got"]))
        assert mine["resharded"] and theirs["resharded"]
