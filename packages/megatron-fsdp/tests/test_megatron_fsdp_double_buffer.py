"""The reference's double-buffer options, honoured by the reduce-buffer allocators:
``fsdp_double_buffer`` (persistent slots per buffer size), ``megatron_fsdp_max_pool_double_buffer``
(one pool sized for the largest unit) and ``fsdp_db_use_persist_buf_on_alloc_fail`` (a
request no slot can serve gets a buffer kept for its unit instead of a fresh allocation).

Each is reached through the seed API (``fully_shard_model``), the reference's class API
(``DistributedDataParallelConfig``), the Megatron-Core adapter (its config's two fields) and
the per-module ``fully_shard`` (``grad_buffer_allocator=DoubleBuffer(max_pool, on_full)``),
at 2 and 4 ranks: training matches one process to 1e-5 over 10 steps, and the memory the pool
keeps is bounded and stops growing after the first step. The pools' own behaviour is tested
in ``mfsdp-buffers`` (``test_buffers_max_pool.py``).
"""

from __future__ import annotations

import os

import pytest
import torch
from mcore_stand_ins import mcore_chunk, mcore_step
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp import (
    DistributedDataParallelConfig,
    FSDPDistributedIndex,
    MegatronFSDP,
    fully_shard_model,
    fully_shard_optimizer,
)
from megatron_fsdp.engine_options import grad_buffer_choice
from megatron_fsdp.mcore import MCoreFSDPModel
from mfsdp_buffers import FixedPoolAllocator, MaxPoolAllocator
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import DoubleBuffer, fsdp_units
from mfsdp_hooks.testing import (
    Block,
    assert_close_rel,
    local_slice,
    loss_fn,
    make_batches,
    make_model,
    train_data_parallel,
    train_single_process,
)
from mfsdp_hooks.testing.parity import shard_blocks

STEPS = 10
FULL = os.environ.get("MFSDP_FULL_MATRIX") == "1"
VARIANTS = ("fixed", "max_pool", "persist")


def _wrap(entry: str, variant: str, world: int) -> torch.nn.Module:
    model = make_model()
    persist = variant == "persist"
    if entry == "per_module":
        on_full = "persistent" if persist else "dynamic"
        allocator = DoubleBuffer(max_pool=variant == "max_pool", on_full=on_full)
        shard_blocks(model, grad_buffer_allocator=allocator)
        return model
    if entry == "mcore":
        return mcore_chunk(  # type: ignore[no-any-return]
            model, [Block], fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=persist
        )
    if entry == "seed":
        return fully_shard_model(
            model,
            [Block],
            fsdp_double_buffer=True,
            fsdp_db_use_persist_buf_on_alloc_fail=persist,
        )
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params",
        fsdp_double_buffer=True,
        megatron_fsdp_max_pool_double_buffer=variant == "max_pool",
        fsdp_db_use_persist_buf_on_alloc_fail=persist,
    )
    index = FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard")
    return MegatronFSDP(model, index, config, fsdp_unit_modules=[Block])


def _reduce_buffer_bytes(model: torch.nn.Module) -> list[int]:
    """The bytes of each group's flat reduce buffer (what the allocator is asked for)."""
    sizes = []
    for unit in fsdp_units(model):
        for group in unit.groups:
            if group.reducer is not None:
                size = torch.empty((), dtype=group.reduce_dtype).element_size()
                sizes.append(group.layout.padded_numel * size)
    return sizes


def _double_buffer_worker(rank: int, world: int, entry: str, variant: str) -> dict[str, object]:
    batches = make_batches(STEPS, 4 * world)
    wrapped = _wrap(entry, variant, world)
    allocator = fsdp_units(wrapped)[0].options.grad_allocator
    kind = MaxPoolAllocator if variant == "max_pool" else FixedPoolAllocator
    assert type(allocator) is kind, type(allocator)
    assert allocator.fallback.on_full == ("persistent" if variant == "persist" else "dynamic")
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    if entry in ("seed", "class"):
        optimizer = fully_shard_optimizer(optimizer)
    reserved = []
    for batch in batches:
        if isinstance(wrapped, MCoreFSDPModel):  # Megatron-Core's loop
            x, y = (local_slice(t, rank, world) for t in batch)
            mcore_step(wrapped, optimizer, loss_fn, x, y)
        else:
            train_data_parallel(wrapped, optimizer, [batch], rank, world)
        reserved.append(allocator.reserved_bytes())
    weights = {
        name.split("module.")[-1]: p.full_tensor().tolist()
        for name, p in wrapped.named_parameters()
    }
    return {"reserved": reserved, "sizes": _reduce_buffer_bytes(wrapped), "weights": weights}


CI_CASES = {
    ("seed", "persist"),
    ("class", "max_pool"),
    ("mcore", "fixed"),
    ("per_module", "max_pool"),
}


def _cases() -> list[object]:
    """Every entry point that has the option (the max pool is not a keyword of the seed API
    nor a field of Megatron-Core's config), at 2 and 4 ranks; CI runs ``CI_CASES`` at 2,
    MFSDP_FULL_MATRIX=1 all."""
    cases = []
    for entry in ("seed", "class", "mcore", "per_module"):
        for variant in VARIANTS:
            if entry in ("seed", "mcore") and variant == "max_pool":
                continue
            for world in (2, 4):
                marks = []
                in_ci = world == 2 and (entry, variant) in CI_CASES
                if not in_ci and not FULL:
                    marks.append(pytest.mark.skip(reason="full matrix only: MFSDP_FULL_MATRIX=1"))
                cases.append(pytest.param(entry, variant, world, marks=marks))
    return cases


@pytest.mark.parametrize(("entry", "variant", "world"), _cases())
def test_double_buffer_options_train_at_parity_within_their_memory_bound(
    entry: str, variant: str, world: int
) -> None:
    results = run_distributed(_double_buffer_worker, world, entry, variant, timeout=240)
    reference = make_model()
    train_single_process(
        reference,
        torch.optim.AdamW(reference.parameters(), lr=1e-2),
        make_batches(STEPS, 4 * world),
    )
    want = dict(reference.named_parameters())
    for rank, result in enumerate(results):
        for name, value in result["weights"].items():  # type: ignore[union-attr]
            assert_close_rel(torch.tensor(value), want[name].detach(), 1e-5, f"{rank} {name}")
        reserved: list[int] = result["reserved"]  # type: ignore[assignment]
        sizes: list[int] = result["sizes"]  # type: ignore[assignment]
        # Persistent: the slots fill during the first two steps (round robin), then the
        # memory kept never changes.
        assert reserved[0] > 0 and len(set(reserved[1:])) == 1, reserved
        slots = 2  # one reduction in flight plus the one being filled
        if variant == "max_pool":  # per dtype, as large as the largest: less than fixed's
            assert reserved[-1] <= slots * max(sizes) < slots * sum(set(sizes)), sizes
        else:
            assert reserved[-1] <= slots * sum(set(sizes)) + (
                sum(sizes) if variant == "persist" else 0
            ), (reserved[-1], sizes)


def _one_slot_worker(rank: int, world: int, on_full: str) -> dict[str, object]:
    """A pool of one slot per size under a window of one reduction in flight: a unit's
    buffer is requested while the previous unit's reduction still holds the slot."""
    batches = make_batches(STEPS, 4 * world)
    model = make_model()
    pool = FixedPoolAllocator(num_slots=1, on_full=on_full)  # type: ignore[arg-type]
    shard_blocks(model, grad_buffer_allocator=pool)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reserved, served = [], []
    for batch in batches:
        train_data_parallel(model, optimizer, [batch], rank, world)
        reserved.append(pool.reserved_bytes())
        served.append(pool.fallback.requests_served)
    weights = {n: p.full_tensor().tolist() for n, p in model.named_parameters()}
    sizes = _reduce_buffer_bytes(model)
    return {"reserved": reserved, "served": served, "weights": weights, "sizes": sizes}


@pytest.mark.parametrize(
    "on_full",
    [
        pytest.param("dynamic", marks=pytest.mark.skipif(not FULL, reason="full matrix only")),
        "persistent",
    ],
)
def test_requests_the_double_buffer_cannot_serve_fall_back_as_configured(on_full: str) -> None:
    results = run_distributed(_one_slot_worker, 2, on_full, timeout=240)
    reference = make_model()
    train_single_process(
        reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), make_batches(STEPS, 8)
    )
    want = dict(reference.named_parameters())
    for rank, result in enumerate(results):
        for name, value in result["weights"].items():  # type: ignore[union-attr]
            assert_close_rel(torch.tensor(value), want[name].detach(), 1e-5, f"{rank} {name}")
        served: list[int] = result["served"]  # type: ignore[assignment]
        reserved: list[int] = result["reserved"]  # type: ignore[assignment]
        sizes: list[int] = result["sizes"]  # type: ignore[assignment]
        assert served[0] > 0 and served[-1] == served[0] * STEPS, served  # every step alike
        assert len(set(reserved[1:])) == 1, reserved  # bounded: nothing new after step 2
        slots = sum(set(sizes))  # one slot per size
        if on_full == "dynamic":  # fresh allocations, returned: only the slots are kept
            assert reserved[-1] == slots, (reserved, sizes)
        else:  # a buffer kept per unit that fell back (one per step here)
            assert slots < reserved[-1] <= slots + served[0] * max(sizes), (reserved, sizes)


@pytest.mark.parametrize(
    "name", ["fsdp_db_use_persist_buf_on_alloc_fail", "megatron_fsdp_max_pool_double_buffer"]
)
def test_shaping_a_double_buffer_that_is_off_is_refused_naming_the_option(name: str) -> None:
    persist, max_pool = name.startswith("fsdp_db"), name.startswith("megatron")
    with pytest.raises(ValueError, match=f"{name}=True .* fsdp_double_buffer=True"):
        grad_buffer_choice(False, persist, max_pool=max_pool)
