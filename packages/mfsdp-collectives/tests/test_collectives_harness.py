"""The multi-rank harness itself: results, fast failure, timeouts."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from mfsdp_collectives.testing import DistributedTestError, run_distributed


def _identity(rank: int, world_size: int, tag: str) -> tuple[int, int, str, int, int, str]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return (
        rank,
        world_size,
        tag,
        int(t.item()),
        torch.get_num_threads(),
        os.environ["OMP_NUM_THREADS"],
    )


def _rank_one_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("bad input on rank one")
    dist.barrier()  # rank 0 would wait here for the dead rank without the fail-fast


def _rank_zero_hangs(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(600)


def _rank_dies(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _env_value(rank: int, world_size: int) -> str:
    return os.environ["MFSDP_TEST_FLAG"]


def test_results_in_rank_order() -> None:
    out = run_distributed(_identity, 3, "x", timeout=60)
    assert [r[0] for r in out] == [0, 1, 2]
    assert all(r[1] == 3 and r[2] == "x" and r[3] == 3 for r in out)
    assert all(r[4] == 1 and r[5] == "1" for r in out), "ranks run single-threaded by default"


def test_env_is_passed() -> None:
    assert run_distributed(_env_value, 2, env={"MFSDP_TEST_FLAG": "on"}) == ["on", "on"]


def test_failing_rank_fails_fast_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_one_raises, 2, timeout=60)
    assert time.monotonic() - start < 20, "must not wait for the timeout"
    err = info.value
    assert err.rank == 1
    assert err.exc_type == "ValueError"
    assert "bad input on rank one" in str(err)
    assert "_rank_one_raises" in err.remote_traceback
    assert isinstance(err.exception, ValueError)


def test_hanging_rank_times_out() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks still running: \[0, 1\]"):
        run_distributed(_rank_zero_hangs, 2, timeout=3)
    assert time.monotonic() - start < 15


def test_rank_that_dies_is_reported() -> None:
    with pytest.raises(DistributedTestError, match="exited with code 3"):
        run_distributed(_rank_dies, 2, timeout=60)


def test_rejects_local_functions_and_bad_arguments() -> None:
    def local(rank: int, world_size: int) -> None:
        pass

    with pytest.raises(TypeError, match="module-level"):
        run_distributed(local, 2)
    with pytest.raises(TypeError, match="module-level"):
        run_distributed(lambda r, w: None, 2)
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_identity, 0)
    with pytest.raises(ValueError, match="timeout"):
        run_distributed(_identity, 2, timeout=0)


def test_rejects_hash_seeds_that_are_not_one_per_rank() -> None:
    for bad in ([0], [0, -1], [0, True], "01"):
        with pytest.raises(ValueError, match="hash_seeds must be one PYTHONHASHSEED"):
            run_distributed(_identity, 2, hash_seeds=bad)  # type: ignore[arg-type]
