"""Interoperability: torch's own DCP tools, torch FSDP2 checkpoints, full single-process state
dicts in and out (torch files, safetensors, in-memory dicts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_models import (
    Block,
    assert_rel,
    assert_states_equal,
    make_batches,
    make_model,
    make_optimizer,
    pack,
    reference_train,
    shard,
    train,
    unpack,
)
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import mfsdp_checkpoint as mc
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing.parity import shard_blocks

SAVE_AT, MORE = 5, 3


def _save_ours(rank: int, world: int, path: str) -> bytes:
    model = shard(make_model(), 3)
    optimizer = make_optimizer(model)
    mc.enable_dcp(model, optimizer)
    train(model, optimizer, make_batches(SAVE_AT), rank, world)
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)
    full = mc.gather_full_state_dict(model)
    assert (rank == 0) == bool(full), "only rank 0 receives the gathered state dict"
    everywhere = mc.gather_full_state_dict(model, rank0_only=False)
    return pack(everywhere)


def test_dcp_to_torch_save_gives_the_unsharded_model(tmp_path: Path) -> None:
    path = tmp_path / "ours"
    gathered = [unpack(b) for b in run_distributed(_save_ours, 3, str(path), timeout=180)]
    assert all(g.keys() == gathered[0].keys() for g in gathered)
    for other in gathered[1:]:
        assert_states_equal(other, gathered[0], "rank0_only=False on every rank")

    dcp_to_torch_save(path, tmp_path / "full.pt")
    plain = torch.load(tmp_path / "full.pt", weights_only=False)
    model_state = {k.removeprefix("module."): v for k, v in plain["model"].items()}
    assert_states_equal(plain["model"], gathered[0], "dcp_to_torch_save vs gather (bitwise)")

    reference, ref_optimizer, _ = reference_train(make_batches(SAVE_AT))
    expected = reference.state_dict()
    assert_states_equal(model_state, dict(expected), "vs single-process training", rtol=1e-5)

    names = {id(p): n for n, p in reference.named_parameters()}
    optim = plain["optimizer"]
    trainable = [n for n, p in reference.named_parameters() if p.requires_grad]
    # torch's positional keys (as NVIDIA Megatron-FSDP's): the optimizer's parameter order
    assert optim["param_groups"][0]["params"] == list(range(len(trainable)))
    assert sorted(int(k) for k in optim["state"]) == list(range(len(trainable)))
    by_name = {trainable[int(k)]: v for k, v in optim["state"].items()}
    for param, state in ref_optimizer.state.items():
        saved = by_name[names[id(param)]]
        assert float(saved["step"]) == SAVE_AT
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(saved[key], state[key], rtol=1e-5, atol=1e-7)


def _full_tensors(rank: int, world: int, strategy: int) -> bytes:
    """What FSDP2 users write for a full state dict: ``full_tensor()`` on every value."""
    model = shard(make_model(), strategy)
    optimizer = make_optimizer(model)
    mc.enable_dcp(model, optimizer)
    train(model, optimizer, make_batches(SAVE_AT), rank, world)
    state = optimizer.state_dict()["state"]
    return pack(
        {
            "model": {k: v.full_tensor() for k, v in model.state_dict().items()},
            "optimizer": {
                name: {k: entry[k].full_tensor() for k in ("exp_avg", "exp_avg_sq")}
                for name, entry in state.items()
            },
        }
    )


@pytest.mark.parametrize("strategy", [3, 1])
def test_full_tensor_of_every_state_dict_value_is_the_one_process_value(strategy: int) -> None:
    reference, ref_optimizer, _ = reference_train(make_batches(SAVE_AT))
    names = {id(p): n for n, p in reference.named_parameters()}
    for blob in run_distributed(_full_tensors, 3, strategy, timeout=180):
        full = unpack(blob)
        model_state = {k.removeprefix("module."): v for k, v in full["model"].items()}
        assert_states_equal(model_state, dict(reference.state_dict()), "full_tensor", rtol=1e-5)
        trainable = [n for n, p in reference.named_parameters() if p.requires_grad]
        for param, state in ref_optimizer.state.items():
            saved = full["optimizer"][trainable.index(names[id(param)])]  # keyed by position
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(saved[key], state[key], rtol=1e-5, atol=1e-7)


def _fsdp2_world(rank: int, world: int, path: str) -> dict[str, Any]:
    """Torch FSDP2 trains, saves with get_*_state_dict, and keeps training for reference."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = make_model()
    shard_blocks(model, "fsdp2")
    optimizer = make_optimizer(model)
    batches = make_batches(SAVE_AT + MORE)
    train(model, optimizer, batches[:SAVE_AT], rank, world)
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }
    dcp.save(state, checkpoint_id=path)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    full = {k: v.detach().cpu().clone() for k, v in full.items()}
    more = train(model, optimizer, batches[SAVE_AT:], rank, world)
    return {"losses": more, "full": pack(full)}


def _load_fsdp2_world(rank: int, world: int, path: str) -> tuple[list[float], bytes]:
    """FSDP2's own resume code, run on ours (enable_dcp for the fresh optimizer's
    placeholders)."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model = shard(make_model(seed=77), 3, api="per_module")
    optimizer = make_optimizer(model)
    mc.enable_dcp(model, optimizer)
    state = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    full = pack(mc.gather_full_state_dict(model))
    batches = make_batches(SAVE_AT + MORE)
    return train(model, optimizer, batches[SAVE_AT:], rank, world), full


def test_fsdp2_checkpoint_loads_into_ours_on_another_world_size(tmp_path: Path) -> None:
    path = str(tmp_path / "fsdp2")
    fsdp2 = run_distributed(_fsdp2_world, 2, path, timeout=180)[0]
    losses, full = run_distributed(_load_fsdp2_world, 3, path, timeout=180)[0]
    assert_states_equal(unpack(full), unpack(fsdp2["full"]), "FSDP2 weights after load")
    assert_rel(losses, fsdp2["losses"], 1e-5, "training after loading the FSDP2 checkpoint")


class RowSpy(torch.Tensor):
    """A source tensor that logs what the loader does with it: only row slices are allowed."""

    log: ClassVar[list[Any]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.__getitem__:
            cls.log.append(("rows", args[1].start, args[1].stop))
        elif func is torch.Tensor.narrow and args[1] == 0:  # rows along dim 0, as a view
            cls.log.append(("rows", args[2], args[2] + args[3]))
        elif getattr(func, "__name__", "") not in ("__get__", "size", "dim", "shape", "dtype"):
            cls.log.append(("call", getattr(func, "__name__", str(func))))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _load_full_world(rank: int, world: int, files: dict[str, str]) -> list[bytes]:
    out = []
    model = shard(make_model(seed=9), 3)
    result = mc.load_full_state_dict(model, files["torch"], strip_prefix="module.")
    assert result.missing_keys == [] and result.unexpected_keys == []
    out.append(pack(mc.gather_full_state_dict(model)))

    model = shard(make_model(seed=9), 2, api="per_module")
    mc.load_full_state_dict(model, files["safetensors"], mode="broadcast")
    out.append(pack(mc.gather_full_state_dict(model)))

    source = {k: v.as_subclass(RowSpy) for k, v in unpack(Path(files["pack"]).read_bytes()).items()}
    model = shard(make_model(seed=9), 3, api="per_module")
    RowSpy.log.clear()
    mc.load_full_state_dict(model, source)
    out.append(pack(mc.gather_full_state_dict(model)))
    from mfsdp_hooks import fsdp_units

    pieces = [
        group.layout.local_piece(i, rank)
        for unit in fsdp_units(model)
        for group in unit.groups
        for i in range(len(group.shapes))
    ]
    expected = sorted(("rows", p.row_start, p.row_end) for p in pieces)
    assert sorted(RowSpy.log) == expected, f"the loader touched more than its rows: {RowSpy.log}"

    # Plain torch API: model.load_state_dict with full tensors cuts them to this rank's rows.
    model = shard(make_model(seed=9), 1)
    handle = mc.enable_dcp(model)
    assert mc.enable_dcp(model).unit_hooks[0] is handle.unit_hooks[0], "enable_dcp is idempotent"
    full = unpack(Path(files["pack"]).read_bytes())
    model.load_state_dict({f"module.{k}": v for k, v in full.items()})
    out.append(pack(mc.gather_full_state_dict(model)))
    mesh = init_device_mesh("cpu", (world,))
    foreign = distribute_tensor(full["blocks.0.fc2.weight"], mesh, placements=[Shard(0)])
    # torch's own cut (set_model_state_dict hands these in): gathered, then our rows taken.
    model.load_state_dict({"module.blocks.0.fc2.weight": foreign * 2}, strict=False)
    got = mc.gather_full_state_dict(model, rank0_only=False)["module.blocks.0.fc2.weight"]
    assert torch.equal(got, full["blocks.0.fc2.weight"] * 2), "a torch.chunk DTensor loaded wrong"
    handle.remove()
    assert all("__create_chunk_list__" not in v.__dict__ for v in model.state_dict().values())
    return out


def test_full_state_dict_loads_into_a_sharded_model_row_by_row(tmp_path: Path) -> None:
    reference = make_model(seed=3)
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    torch.save(state, tmp_path / "full.pt")
    untied = {k: v for k, v in state.items() if k != "head.weight"}  # how HF stores tied heads
    save_file(untied, tmp_path / "full.safetensors")
    (tmp_path / "full.bin").write_bytes(pack(state))
    files = {
        "torch": str(tmp_path / "full.pt"),
        "safetensors": str(tmp_path / "full.safetensors"),
        "pack": str(tmp_path / "full.bin"),
    }
    results = run_distributed(_load_full_world, 3, files, timeout=180)[0]
    wrapped = {f"module.{k}": v for k, v in state.items()}
    assert_states_equal(unpack(results[0]), wrapped, "torch file (mmap) into FSDPRootWrapper")
    assert_states_equal(unpack(results[1]), state, "safetensors (broadcast), tied head omitted")
    assert_states_equal(unpack(results[2]), state, "in-memory dict")
    assert_states_equal(unpack(results[3]), wrapped, "model.load_state_dict(full tensors)")


def _export_world(rank: int, world: int, out: str) -> None:
    model = shard(make_model(seed=4), 3)
    mc.save_full_state_dict(model, out, strip_prefix="module.")


@pytest.mark.parametrize("world", [2])
def test_save_full_state_dict_streams_a_file_plain_models_load(tmp_path: Path, world: int) -> None:
    out = tmp_path / "export.safetensors"
    run_distributed(_export_world, world, str(out), timeout=120)
    plain = make_model(seed=99)
    loaded = load_file(out)
    plain.load_state_dict(loaded, strict=True)
    assert_states_equal(dict(plain.state_dict()), dict(make_model(seed=4).state_dict()), "export")
    assert Block  # the model's unit class, kept importable for readers of this test


def _load_wrong_named_state(rank: int, world: int) -> list[str]:
    model = shard(make_model(), 3)
    optimizer = make_optimizer(model)
    mc.enable_dcp(model, optimizer)
    train(model, optimizer, make_batches(1), rank, world)
    named = mc.named_optimizer_state_dict(model, optimizer)
    (group,) = named["param_groups"]
    first = group["params"][0]
    wrong = [
        {**named, "param_groups": [group, group]},
        {**named, "param_groups": [{**group, "params": group["params"][1:]}]},
        {**named, "state": {**named["state"], "module.head.scale": named["state"][first]}},
    ]
    before = _local_state(optimizer)
    assert before, "the training step made optimizer state"
    messages = []
    for state in wrong:
        try:
            optimizer.load_state_dict(state)
            messages.append("loaded")
        except ValueError as error:
            messages.append(str(error))
    after = _local_state(optimizer)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    return [first, *messages]


def _local_state(optimizer: torch.optim.Optimizer) -> dict[tuple[int, str], torch.Tensor]:
    """This rank's optimizer state, by parameter position: a refused load left it as it was."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        (i, key): (value.to_local() if isinstance(value, DTensor) else value).clone()
        for i, p in enumerate(params)
        for key, value in optimizer.state.get(p, {}).items()
    }


def test_a_name_keyed_optimizer_state_that_does_not_fit_is_refused_by_name() -> None:
    """enable_dcp's ``optimizer.load_state_dict`` of a state keyed by parameter name (what
    ``named_optimizer_state_dict`` gives): another grouping, a group lacking a parameter and
    state for a parameter the optimizer does not hold are each refused, naming it, and leave
    the optimizer's state as it was."""
    for first, groups, group, state in run_distributed(_load_wrong_named_state, 2, timeout=120):
        assert groups == (
            "optimizer.load_state_dict: the state dict has 2 parameter groups, the optimizer 1"
        )
        assert group == (
            f"optimizer.load_state_dict: parameter group 0 differs; missing parameters "
            f"[{first!r}], unexpected parameters []"
        )
        assert state == (
            "optimizer.load_state_dict: state for 'module.head.scale', which is not a "
            "parameter of this optimizer"
        )
