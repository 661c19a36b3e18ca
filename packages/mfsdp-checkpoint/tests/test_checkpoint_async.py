"""``async_save_checkpoint``: training goes on while the checkpoint is written, the result is
the synchronous save's checkpoint, and resuming from it is exact.

The data writes of the first save are held back (on the background thread) until training has
taken ``DURING`` more steps, so the test proves the overlap instead of hoping for it: a save that
ran on the training thread would wait for steps that never come, and fail after 20 s.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from checkpoint_models import (
    assert_rel,
    assert_states_equal,
    make_batches,
    make_model,
    make_optimizer,
    pack,
    shard,
    train,
    unpack,
)
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.tensor import DTensor

import mfsdp_checkpoint as mc
from mfsdp_checkpoint.marker import MARKER
from mfsdp_collectives.testing import run_distributed

PRE, DURING = 3, 3
MAIN = threading.main_thread()
_TIMEOUT = 60


def _optimizer_locals(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's piece of every optimizer state tensor, keyed ``name/key``."""
    out = {}
    for name, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                out[f"{name}/{key}"] = local.detach().clone()
    return out


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> bytes:
    return pack({"model": mc.gather_full_state_dict(model), "optim": _optimizer_locals(optimizer)})


def _skew_background_collectives(rank: int) -> None:
    """Delay the save thread's first collective on rank 0 only, so the two ranks interleave
    the save's collectives and training's differently: harmless on a group of the save's
    own, a mismatch (error or hang) if the save shared the training group."""
    original = dist.all_gather_object
    delayed = [False]

    def skewed(*args: Any, **kwargs: Any) -> Any:
        if rank == 0 and not delayed[0] and threading.current_thread() is not MAIN:
            delayed[0] = True
            time.sleep(1.0)
        return original(*args, **kwargs)

    dist.all_gather_object = skewed


def _hold_writes() -> tuple[threading.Event, list[str]]:
    """Make DCP's data writes wait for ``gate``; record which thread wrote."""
    gate, writers = threading.Event(), []
    original = FileSystemWriter.write_data

    def held(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        writers.append(threading.current_thread().name)
        if not gate.wait(timeout=20):
            raise AssertionError("the save blocked the training thread (it is not asynchronous)")
        return original(self, plan, planner)

    FileSystemWriter.write_data = held  # type: ignore[method-assign,assignment]
    return gate, writers


def _async_world(rank: int, world: int, paths: dict[str, str]) -> dict[str, Any]:
    batches = make_batches(PRE + 2 * DURING)
    model = shard(make_model(), 3)
    optimizer = make_optimizer(model)
    train(model, optimizer, batches[:PRE], rank, world)
    mc.save_checkpoint(paths["sync"], model, optimizer, extra={"step": PRE})
    out: dict[str, Any] = {"at_first": _snapshot(model, optimizer)}

    _skew_background_collectives(rank)
    gate, writers = _hold_writes()
    first = mc.async_save_checkpoint(paths["first"], model, optimizer, extra={"step": PRE})
    out["pending"] = [not first.done()]
    out["during"] = []
    for batch in batches[PRE : PRE + DURING]:  # these steps change the weights being saved
        out["during"] += train(model, optimizer, [batch], rank, world)
        out["pending"].append(not first.done())
    out["at_second"] = _snapshot(model, optimizer)

    threading.Timer(0.5, gate.set).start()
    second = mc.async_save_checkpoint(
        paths["second"], model, optimizer, extra={"step": PRE + DURING}
    )
    out["first_done_before_second"] = first.done()
    out["results"] = [str(first.result(timeout=60)), str(second.result(timeout=60))]
    out["after"] = train(model, optimizer, batches[PRE + DURING :], rank, world)
    out["final"] = _snapshot(model, optimizer)
    out["writers"] = writers
    return out


def _resume_world(rank: int, world: int, paths: dict[str, str]) -> dict[str, Any]:
    """Fresh models (another init) load each async checkpoint and take the next steps."""
    batches = make_batches(PRE + 2 * DURING)
    out = {}
    for key, start in (("first", PRE), ("second", PRE + DURING)):
        model = shard(make_model(seed=9), 3)
        optimizer = make_optimizer(model)
        extra = mc.load_checkpoint(paths[key], model, optimizer, extra={"step": -1})
        loaded = _snapshot(model, optimizer)
        losses = train(model, optimizer, batches[start : start + DURING], rank, world)
        out[key] = {
            "extra": extra,
            "loaded": loaded,
            "losses": losses,
            "final": _snapshot(model, optimizer),
        }
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("async")
    paths = {key: str(root / key) for key in ("sync", "first", "second")}
    return {
        "paths": paths,
        "train": run_distributed(_async_world, 2, paths, timeout=_TIMEOUT),
        "resume2": run_distributed(_resume_world, 2, paths, timeout=_TIMEOUT),
        "resume1": run_distributed(_resume_world, 1, paths, timeout=_TIMEOUT)[0],
    }


def test_training_runs_while_the_save_writes(saved: dict[str, Any]) -> None:
    for rank, out in enumerate(saved["train"]):
        assert out["pending"] == [True] * (DURING + 1), f"rank {rank}: {out['pending']}"
        assert len(out["writers"]) == 2, f"rank {rank}: writes {out['writers']}"
        assert all(n.startswith("mfsdp-checkpoint") for n in out["writers"]), out["writers"]
        assert out["results"] == [saved["paths"]["first"], saved["paths"]["second"]]


def test_second_save_waits_for_the_first(saved: dict[str, Any]) -> None:
    assert [out["first_done_before_second"] for out in saved["train"]] == [True, True]


def test_async_checkpoint_is_the_sync_checkpoint(saved: dict[str, Any]) -> None:
    sync, first = Path(saved["paths"]["sync"]), Path(saved["paths"]["first"])
    names = sorted(p.name for p in sync.iterdir())
    assert names == sorted(p.name for p in first.iterdir())
    assert MARKER in names and not Path(f"{first}.partial").exists()
    for name in names:
        if name.endswith(".distcp"):
            assert (sync / name).read_bytes() == (first / name).read_bytes(), name
    sync_meta, first_meta = mc.read_metadata(sync), mc.read_metadata(first)
    assert sync_meta.state_dict_metadata == first_meta.state_dict_metadata
    assert sync_meta.storage_data == first_meta.storage_data


def test_resume_from_async_save_is_exact(saved: dict[str, Any]) -> None:
    trained = saved["train"]
    for key, moment, continued, later in (
        ("first", "at_first", "during", "at_second"),
        ("second", "at_second", "after", "final"),
    ):
        for rank, resumed in enumerate(r[key] for r in saved["resume2"]):
            assert resumed["extra"] == {"step": PRE if key == "first" else PRE + DURING}
            want, got = unpack(trained[rank][moment]), unpack(resumed["loaded"])
            assert_states_equal(got["model"], want["model"], f"{key}: loaded weights")
            assert_states_equal(got["optim"], want["optim"], f"{key}: loaded optimizer state")
            assert resumed["losses"] == trained[rank][continued], f"{key}: resumed losses"
            want, got = unpack(trained[rank][later]), unpack(resumed["final"])
            assert_states_equal(got["model"], want["model"], f"{key}: weights after resuming")
            assert_states_equal(got["optim"], want["optim"], f"{key}: optimizer after resuming")


def test_resume_on_one_rank_reshards(saved: dict[str, Any]) -> None:
    trained = saved["train"][0]
    resumed = saved["resume1"]["first"]
    loaded = unpack(resumed["loaded"])["model"]
    assert_states_equal(loaded, unpack(trained["at_first"])["model"], "resharded weights")
    assert_rel(resumed["losses"], trained["during"], 1e-6, "losses resumed on one rank")
    final = unpack(resumed["final"])["model"]
    want = unpack(trained["at_second"])["model"]
    assert_states_equal(final, want, "weights resumed on one rank", rtol=1e-5)


def test_async_save_refuses_reserved_names_before_copying(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"path: .*\.partial"):
        mc.async_save({"x": torch.zeros(2)}, tmp_path / "step.partial")


def _torch_async_save_world(rank: int, world: int, path: str) -> dict[str, Any]:
    """torch's own ``dcp.async_save`` on our state dicts, over a group of its own, staged by
    ``CheckpointStager`` (torch's default stager fails on them: see its docstring)."""
    import torch.distributed.checkpoint as dcp

    batches = make_batches(PRE + DURING)
    model = shard(make_model(), 3)
    optimizer = make_optimizer(model)
    train(model, optimizer, batches[:PRE], rank, world)
    mc.enable_dcp(model, optimizer)
    at_save = _snapshot(model, optimizer)
    save_group = dist.new_group(backend="gloo")
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    future = dcp.async_save(
        state,
        checkpoint_id=path,
        process_group=save_group,
        async_stager=mc.CheckpointStager(),
    )
    train(model, optimizer, batches[PRE:], rank, world)  # the weights move under the save
    future.result()
    fresh = shard(make_model(seed=9), 3)
    fresh_optimizer = make_optimizer(fresh)
    mc.enable_dcp(fresh, fresh_optimizer)
    loaded = {"model": fresh.state_dict(), "optimizer": fresh_optimizer.state_dict()}
    dcp.load(loaded, checkpoint_id=path)
    fresh.load_state_dict(loaded["model"], strict=False)
    fresh_optimizer.load_state_dict(loaded["optimizer"])
    return {"at_save": at_save, "loaded": _snapshot(fresh, fresh_optimizer)}


def test_torch_dcp_async_save_of_our_state_dicts_resumes_exactly(tmp_path: Path) -> None:
    for result in run_distributed(
        _torch_async_save_world, 2, str(tmp_path / "torch_async"), timeout=_TIMEOUT
    ):
        loaded, at_save = unpack(result["loaded"]), unpack(result["at_save"])
        for section in ("model", "optim"):
            assert_states_equal(loaded[section], at_save[section], f"dcp.async_save {section}")


def _first_async_save_after_a_death(rank: int, world: int, path: str) -> str:
    import os
    import signal

    from mfsdp_collectives import exchange_identities

    exchange_identities(dist.group.WORLD)  # what wrapping a model does
    dist.barrier()
    if rank == 1:
        time.sleep(0.3)  # the survivor is inside the first async save's setup by now
        os.kill(os.getpid(), signal.SIGKILL)
    mc.async_save({"step": torch.tensor([rank])}, path).result()
    return "the save finished although a peer died"


def test_a_peer_dead_before_the_first_async_save_is_named_within_seconds(tmp_path: Path) -> None:
    """The first async save makes its background group, a rendezvous of every rank: a rank
    that died meanwhile is named at once, not after the store's 30-minute timeout."""
    from mfsdp_collectives import PeerDiedError
    from mfsdp_collectives.testing import run_distributed_outcomes

    outcomes = run_distributed_outcomes(
        _first_async_save_after_a_death, 2, str(tmp_path / "ckpt"), timeout=_TIMEOUT
    )
    death, survivor = outcomes[1], outcomes[0]
    assert death.died, death
    assert survivor.error is not None, survivor.result
    assert isinstance(survivor.error.exception, PeerDiedError), survivor.error
    assert "rank 1 (pid" in str(survivor.error.exception)
    assert survivor.at - death.at < 5.0, f"raised {survivor.at - death.at:.1f}s after the death"
