"""Our units are instances of torch's ``torch.distributed.fsdp.FSDPModule`` (so torch's
pipelining and tools that check that class see them), and every public method of torch's
class is ours: implemented, or refused naming itself, never FSDP2's code reaching for the
private state our units do not have."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from hooks_models import Block, loss_fn, make_batches, make_model, shard_blocks
from torch import nn

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import FSDPModule, FSDPRootWrapper, fsdp_units
from mfsdp_hooks.api.fully_shard import fsdp_class_of


def _torch_methods() -> list[str]:
    """Torch FSDPModule's methods a caller may reach (public, plus the one tools call)."""
    names = [n for n, v in vars(torch_fsdp.FSDPModule).items() if inspect.isfunction(v)]
    return [n for n in names if not n.startswith("__")]


def test_every_method_of_torchs_fsdpmodule_is_ours() -> None:
    cls = fsdp_class_of(nn.Linear)
    assert issubclass(cls, torch_fsdp.FSDPModule) and issubclass(cls, FSDPModule)
    theirs = _torch_methods()
    assert {"unshard", "set_requires_gradient_sync", "_get_fsdp_state"} <= set(theirs)
    inherited = [n for n in theirs if getattr(cls, n) is getattr(torch_fsdp.FSDPModule, n)]
    assert inherited == []


def test_constructing_an_fsdp_class_builds_the_original_class_as_torchs_does() -> None:
    """Torch's ``FSDPModule.__new__`` (container slicing calls ``type(m)(...)``) finds the
    original class at ``_orig_cls_mro_index``: ours has one more base before it."""
    made = fsdp_class_of(nn.Linear)(3, 2)
    assert type(made) is nn.Linear


def _isinstance_worker(rank: int, world: int, api: str) -> list[str]:
    model = make_model()
    if api == "per_module":
        shard_blocks(model, "ours")
        wrapped: nn.Module = model
    else:
        wrapped = FSDPRootWrapper(model, fsdp_unit_modules=[Block]).module
    modules = [m for m in wrapped.modules() if isinstance(m, FSDPModule)]
    assert len(modules) == len(fsdp_units(wrapped)) == 4
    assert all(isinstance(m, torch_fsdp.FSDPModule) for m in modules)
    # torch's pipelining calls these on a stage module; our units take them.
    wrapped.set_is_last_backward(False)  # type: ignore[operator]
    wrapped.set_reshard_after_backward(False)  # type: ignore[operator]
    wrapped.set_requires_gradient_sync(False)  # type: ignore[operator]
    tokens, targets = make_batches(1)[0]
    loss_fn(wrapped(tokens), targets).backward()
    handle = modules[1].unshard(async_op=True)  # as the runtime schedules' UNSHARD action
    assert isinstance(handle, torch_fsdp.UnshardHandle)
    handle.wait()
    modules[1].reshard()
    errors = []
    for call in (
        lambda: modules[1].set_unshard_in_backward(False),
        lambda: modules[1].set_symm_mem_for_comm(),
        lambda: modules[1]._get_fsdp_state(),
        lambda: modules[1].set_reduce_scatter_unused_params(True),
        lambda: modules[1].set_reduce_scatter_max_input_buffers(2),
        lambda: modules[1].set_separate_reduce_scatter_group(),
        lambda: modules[1].set_allocate_memory_from_process_group_for_comm(True),
        lambda: modules[1]._set_unshard_async_op(True),
    ):
        with pytest.raises(NotImplementedError) as caught:
            call()
        errors.append(str(caught.value))
    return errors


@pytest.mark.parametrize("api", ["per_module", "root_wrapper"])
def test_units_are_torchs_fsdpmodule_and_refuse_what_they_lack(api: str) -> None:
    for errors in run_distributed(_isinstance_worker, 2, api, timeout=60):
        assert errors[0].startswith("set_unshard_in_backward(False) is not supported yet")
        assert errors[1].startswith("set_symm_mem_for_comm is not supported yet")
        assert "keeps no FSDP2 state" in errors[2]
        assert errors[3].startswith("set_reduce_scatter_unused_params is not supported yet")
        assert "pass max_inflight_reductions to the root's fully_shard" in errors[4]
        assert errors[5].startswith("set_separate_reduce_scatter_group is not supported yet")
        assert errors[6].startswith(
            "set_allocate_memory_from_process_group_for_comm(True) is not supported yet"
        )
        assert errors[7].startswith("_set_unshard_async_op is not supported yet")


def _mem_tracker_worker(rank: int, world: int) -> str:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    model = make_model()
    shard_blocks(model, "ours")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(NotImplementedError) as caught, FSDPMemTracker(model, optimizer):
        pass
    return str(caught.value)


def test_fsdp2s_memory_tracker_says_it_needs_fsdp2s_private_state() -> None:
    """``FSDPMemTracker`` instruments FSDP2's ``FSDPParamGroup``s through
    ``_get_fsdp_state()``; ours has none, and says so instead of an AttributeError."""
    message = run_distributed(_mem_tracker_worker, 2, timeout=60)[0]
    assert "FSDPToyModel is sharded by megatron-fsdp, which keeps no FSDP2 state" in message
