"""Mistakes raise a clear error on every rank before any collective is issued."""

from __future__ import annotations

import pytest
import torch
from hooks_models import Block, make_model
from torch import nn

from mfsdp_collectives import CommTracer
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import FSDPRootWrapper, MixedPrecisionPolicy, fully_shard


class _TiedAcrossUnits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.second.weight = self.first.weight


def _bad_input_worker(rank: int, world: int, case: str) -> str:
    with CommTracer() as tracer:
        try:
            if case == "twice":
                block = Block()
                fully_shard(block)
                fully_shard(block)
            elif case == "strategy":
                fully_shard(Block(), sharding_strategy=4)
            elif case == "strategy_type":
                fully_shard(Block(), sharding_strategy=2.5)  # type: ignore[arg-type]
            elif case == "policy":
                fully_shard(Block(), mp_policy="bf16")  # type: ignore[arg-type]
            elif case == "policy_dtype":
                MixedPrecisionPolicy(param_dtype=torch.int8)
            elif case == "tied_across_units":
                model = _TiedAcrossUnits()
                fully_shard(model.second)
                fully_shard(model)
            elif case == "unknown_option":
                fully_shard(Block(), fsdp_unit_size=4)
            elif case == "scaling_and_per_token":
                fully_shard(Block(), gradient_scaling_factor=0.5, calculate_per_token_loss=True)
            elif case == "unit_class":
                FSDPRootWrapper(make_model(), fsdp_unit_modules=[42])  # type: ignore[list-item]
            elif case == "unit_path":
                FSDPRootWrapper(make_model(), fsdp_unit_modules=["Block"])
            elif case == "host_transport":
                fully_shard(Block(), host_transport="tcp")
            elif case == "prefetch_fraction":
                fully_shard(Block(), backward_prefetch_grad_fraction=1.5)
        except (ValueError, TypeError, NotImplementedError) as error:
            assert tracer.records == [], "a collective ran before the error"
            return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("twice", "ValueError: module: fully_shard was already applied to this Block"),
        ("strategy", "ValueError: sharding_strategy=4 is out of range"),
        ("strategy_type", "TypeError: sharding_strategy must be an int 0-3 or a strategy name"),
        ("policy", "TypeError: mp_policy must be an mfsdp_hooks.MixedPrecisionPolicy"),
        ("policy_dtype", "TypeError: MixedPrecisionPolicy.param_dtype must be a floating-point"),
        ("tied_across_units", "ValueError: parameter 'first.weight' of _TiedAcrossUnits is shared"),
        ("unknown_option", "TypeError: fully_shard() got unsupported argument(s) fsdp_unit_size"),
        ("scaling_and_per_token", "ValueError: gradient_scaling_factor and calculate_per_token"),
        ("unit_class", "TypeError: fsdp_unit_modules entries must be nn.Module subclasses"),
        ("unit_path", "ValueError: fsdp_unit_modules: 'Block' is not an import path"),
        ("host_transport", "ValueError: host_transport='tcp' is not one of"),
        ("prefetch_fraction", "ValueError: backward_prefetch_grad_fraction=1.5 is outside [0, 1]"),
    ],
)
def test_bad_input_is_rejected_on_every_rank(case: str, expected: str) -> None:
    messages = run_distributed(_bad_input_worker, 2, case, timeout=60)
    assert all(m.startswith(expected) for m in messages), messages


def _gloo_after_shm(rank: int, world: int) -> str:
    fully_shard(Block(), host_transport="shm")
    try:
        fully_shard(Block(), host_transport="gloo")
    except ValueError as error:
        return str(error)
    return "no error"


def test_gloo_cannot_be_asked_for_a_group_already_on_shared_memory() -> None:
    for message in run_distributed(_gloo_after_shm, 2, timeout=60):
        assert message.startswith("host_transport='gloo', but an earlier fully_shard"), message
