"""The seed's HSDP arguments of fully_shard_model: parity on a 2x2 mesh, and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_megatron_fsdp_api import Layer, _model
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp import fully_shard_model, fully_shard_optimizer
from mfsdp_collectives.testing import run_distributed

STEPS = 10


def _hybrid_model(zero: int, outer_strategy: object) -> torch.nn.Module:
    """The test model on 4 ranks as (dp_outer=2, dp_shard=2)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    return fully_shard_model(
        _model(),
        fsdp_unit_modules=[Layer],
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        dp_outer_dim="dp_outer",
        hybrid_fsdp_group=dist.group.WORLD,  # the flattened (dp_outer, dp_shard) submesh
        zero_dp_strategy=zero,
        outer_dp_sharding_strategy=outer_strategy,  # type: ignore[arg-type]
    )


def _hsdp_worker(rank: int, world: int, zero: int, outer_strategy: object) -> list[float]:
    return _train_against_one_process(_hybrid_model(zero, outer_strategy), rank, world)


def _train_against_one_process(model: torch.nn.Module, rank: int, world: int) -> list[float]:
    """Relative loss error per step of ``model`` (each rank a quarter of the batch) against
    the same model trained in one process on the whole batch."""
    batch = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    reference = _model()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    optimizer = fully_shard_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    errors = []
    for _ in range(STEPS):
        want = reference(batch).pow(2).mean()
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = model(batch.chunk(world)[rank]).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        errors.append(abs(total.item() / world - want.item()) / abs(want.item()))
    return errors


@pytest.mark.parametrize(
    ("zero", "outer_strategy"), [(3, 0), (1, "no_shard"), (2, 0), (3, 1), (3, "optim")]
)
def test_fully_shard_model_hsdp_and_hfsdp_train_as_one_process(
    zero: int, outer_strategy: object
) -> None:
    for errors in run_distributed(_hsdp_worker, 4, zero, outer_strategy, timeout=180):
        assert max(errors) <= 1e-5, errors


def _bad_hsdp(rank: int, world: int, case: str) -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    half = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    kwargs: dict[str, object] = {
        "device_mesh": mesh,
        "dp_shard_dim": "dp_shard",
        "dp_outer_dim": "dp_outer",
        "hybrid_fsdp_group": dist.group.WORLD,
    }
    if case == "no_group":
        del kwargs["hybrid_fsdp_group"]
    elif case == "no_outer_dim":
        del kwargs["dp_outer_dim"]
    elif case == "wrong_group":
        kwargs["hybrid_fsdp_group"] = half
    elif case == "unknown_dim":
        kwargs["dp_outer_dim"] = "dp_replicate"
    elif case == "hfsdp_zero1":
        kwargs.update(outer_dp_sharding_strategy=1, zero_dp_strategy=1)
    elif case == "hfsdp_without_outer":
        del kwargs["dp_outer_dim"], kwargs["hybrid_fsdp_group"], kwargs["device_mesh"]
        kwargs["outer_dp_sharding_strategy"] = "optim"
    elif case == "outer_strategy":
        kwargs["outer_dp_sharding_strategy"] = 2
    try:
        fully_shard_model(_model(), fsdp_unit_modules=[Layer], **kwargs)  # type: ignore[arg-type]
    except (ValueError, TypeError, NotImplementedError) as error:
        dist.barrier()  # every rank got here on its own: nothing was communicated
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("no_group", "ValueError: dp_outer_dim was given without hybrid_fsdp_group"),
        ("no_outer_dim", "ValueError: hybrid_fsdp_group was given without dp_outer_dim"),
        ("wrong_group", "ValueError: hybrid_fsdp_group holds ranks"),
        ("unknown_dim", "ValueError: dp_shard_dim='dp_shard' and dp_outer_dim='dp_replicate'"),
        ("hfsdp_zero1", "ValueError: outer_dp_sharding_strategy='optim' (HFSDP) needs"),
        ("hfsdp_without_outer", "ValueError: outer_dp_sharding_strategy='optim' (HFSDP) shards"),
        ("outer_strategy", "ValueError: outer_dp_sharding_strategy=2 is not one of"),
    ],
)
def test_bad_hsdp_arguments_raise_clearly_on_every_rank(case: str, expected: str) -> None:
    messages = run_distributed(_bad_hsdp, 4, case, timeout=60)
    assert all(m.startswith(expected) for m in messages), messages
    if case == "wrong_group":
        assert all("[0, 1, 2, 3]" in m and "dp_outer" in m for m in messages), messages


def _context_parallel_worker(rank: int, world: int) -> list[float]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    model = fully_shard_model(
        _model(), fsdp_unit_modules=[Layer], device_mesh=mesh, dp_shard_dim="dp_shard_cp"
    )
    # Each of the DP x CP ranks holds its own quarter of the tokens, as context parallelism
    # splits sequences: the gradient is the mean over all four.
    return _train_against_one_process(model, rank, world)


def test_a_flattened_dp_x_cp_dim_shards_over_both_and_trains_as_one_process() -> None:
    for errors in run_distributed(_context_parallel_worker, 4, timeout=180):
        assert max(errors) <= 1e-5, errors


def _hsdp_with_context_parallel_worker(rank: int, world: int) -> list[float]:
    dims = ("dp_outer", "dp_shard", "cp")
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=dims)
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    model = fully_shard_model(
        _model(),
        fsdp_unit_modules=[Layer],
        device_mesh=mesh,
        dp_shard_dim="dp_shard_cp",
        dp_outer_dim="dp_outer",
        hybrid_fsdp_group=dist.group.WORLD,  # (dp_outer, dp_shard_cp) spans the 4 ranks
    )
    return _train_against_one_process(model, rank, world)


def test_hsdp_over_a_flattened_dp_x_cp_shard_dim_trains_as_one_process() -> None:
    for errors in run_distributed(_hsdp_with_context_parallel_worker, 4, timeout=180):
        assert max(errors) <= 1e-5, errors


def _hfsdp_full_state_worker(rank: int, world: int, rank0_only: bool) -> bool:
    """Under HFSDP, gathering the full state dict puts the sub-shards back in layout order
    (the group's rank order is not sub-shard order): it equals the gathered compute weights.
    """
    from mfsdp_checkpoint import gather_full_state_dict
    from mfsdp_hooks import fsdp_units, locate

    model = _hybrid_model(3, "optim")
    _train_against_one_process(model, rank, world)  # the weights moved away from the init
    gathered = gather_full_state_dict(model, rank0_only=rank0_only)
    units = fsdp_units(model)
    for unit in units:
        unit.unshard()
    compute = {}
    for name, param in model.module.named_parameters():
        location = locate(param)
        assert location is not None
        compute[name] = location.group.unsharded_params[location.index].detach().clone()
    for unit in units:
        unit.reshard()
    if rank0_only and rank != 0:
        return gathered == {}
    found = {name.removeprefix("module."): value for name, value in gathered.items()}
    return found.keys() == compute.keys() and all(
        torch.equal(found[k], compute[k]) for k in compute
    )


@pytest.mark.parametrize("rank0_only", [True, False])
def test_hfsdp_full_state_dict_reassembles_the_sub_shards_in_order(rank0_only: bool) -> None:
    assert run_distributed(_hfsdp_full_state_worker, 4, rank0_only, timeout=180) == [True] * 4
