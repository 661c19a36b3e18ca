"""Mistakes raise a clear error on every rank before any collective is issued."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hooks_models import Block, make_model
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mfsdp_collectives import CommTracer, FSDPTopology
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import (
    DoubleBuffer,
    ExpertSharding,
    FSDPRootWrapper,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)


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


def _one_world_cases(mesh_3d: DeviceMesh) -> dict[str, Callable[[], object]]:
    """Each a mistake whose error no other test raises; they share one world."""
    unit = fully_shard(Block())
    topology = FSDPTopology.default(torch.device("cpu"))
    return {
        "strategy_bool": lambda: fully_shard(Block(), sharding_strategy=True),
        "experts": lambda: fully_shard(Block(), experts="all"),  # type: ignore[arg-type]
        "mesh_3d": lambda: fully_shard(Block(), mesh=mesh_3d),
        "mesh_type": lambda: fully_shard(Block(), mesh="dp"),  # type: ignore[arg-type]
        "allocator_object": lambda: fully_shard(Block(), grad_buffer_allocator=object()),  # type: ignore[arg-type]
        "allocator_name": lambda: fully_shard(Block(), grad_buffer_allocator="pool"),
        "on_full": lambda: DoubleBuffer(on_full="wait"),  # type: ignore[arg-type]
        "mean_over_type": lambda: ExpertSharding(topology, mean_over=True),
        "mean_over": lambda: ExpertSharding(topology, mean_over=3),
        "wrapper_module": lambda: FSDPRootWrapper("net"),  # type: ignore[arg-type]
        "unit_not_module": lambda: FSDPRootWrapper(
            make_model(), fsdp_unit_modules=["torch.Tensor"]
        ),
        "method_unsharded": lambda: register_fsdp_forward_method(nn.Linear(2, 2), "forward"),
        "method_missing": lambda: register_fsdp_forward_method(unit, "generate"),
        "divide_factor": lambda: unit.set_gradient_divide_factor(0),
        "force_sum": lambda: unit.set_force_sum_reduction_for_comms(1),
        "sync_flag": lambda: unit.set_requires_gradient_sync("yes"),
    }


ONE_WORLD_EXPECTED = {
    "strategy_bool": "TypeError: sharding_strategy must be an int 0-3 or a strategy name, got True",
    "experts": "TypeError: experts must be an mfsdp_hooks.ExpertSharding or None, got str",
    "mesh_3d": "NotImplementedError: mesh has 3 dims ('a', 'b', 'c'): fully_shard takes a 1-D",
    "mesh_type": "TypeError: mesh must be a DeviceMesh or None, got str",
    "allocator_object": "TypeError: grad_buffer_allocator must be one of",
    "allocator_name": "ValueError: grad_buffer_allocator='pool' is not an allocator: use one of",
    "on_full": "ValueError: DoubleBuffer.on_full must be one of",
    "mean_over_type": "TypeError: mean_over must be an int, got True",
    "mean_over": "ValueError: mean_over=3 must be the data-parallel size, a multiple of the "
    "expert-data-parallel size 2",
    "wrapper_module": "TypeError: module must be an nn.Module, got str",
    "unit_not_module": "ValueError: fsdp_unit_modules: 'torch.Tensor' is not an nn.Module subclass",
    "method_unsharded": "ValueError: register_fsdp_forward_method: Linear is not fully sharded",
    "method_missing": "ValueError: register_fsdp_forward_method: FSDPBlock has no method "
    "'generate'",
    "divide_factor": "ValueError: factor must be positive, got 0",
    "force_sum": "ValueError: enable must be a bool, got 1",
    "sync_flag": "ValueError: requires_gradient_sync must be a bool, got 'yes'",
}


def _one_world_worker(rank: int, world: int) -> dict[str, str]:
    mesh_3d = init_device_mesh("cpu", (1, 1, world), mesh_dim_names=("a", "b", "c"))
    messages = {}
    for case, call in _one_world_cases(mesh_3d).items():
        with CommTracer() as tracer:
            try:
                call()
                messages[case] = "no error"
            except (ValueError, TypeError, NotImplementedError) as error:
                messages[case] = f"{type(error).__name__}: {error}"
        assert tracer.records == [], f"{case}: a collective ran before the error"
    return messages


def test_more_bad_input_is_rejected_on_every_rank_in_one_world() -> None:
    for messages in run_distributed(_one_world_worker, 2, timeout=120):
        assert messages.keys() == ONE_WORLD_EXPECTED.keys()
        wrong = {c: m for c, m in messages.items() if not m.startswith(ONE_WORLD_EXPECTED[c])}
        assert not wrong, wrong
