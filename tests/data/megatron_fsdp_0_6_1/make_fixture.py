"""Write the megatron-fsdp==0.6.1 reference DCP checkpoints of this directory.

Run (CPU, gloo, in a venv holding NVIDIA's megatron-fsdp 0.6.1 and NOT our packages;
see README.md next to this file):

    /tmp/ref_venv/bin/torchrun --standalone --nproc-per-node 2 \
        tests/data/megatron_fsdp_0_6_1/make_fixture.py

For each optimizer kind of tests/reference_fixture.py it builds the toy model, shards it with
the reference's ``fully_shard`` (ZeRO-3, ``fsdp_unit_modules=[Block]``,
``preproc_state_dict_for_dcp_ckpt=True``, 2-rank DP mesh), trains ``SAVE_AT`` steps on
``local_batch(step, rank, 2)`` and saves the reference README's state dict
``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}`` with
``torch.distributed.checkpoint.save`` into ``<kind>/``. ``writer.json`` records the run.

The reference is written for CUDA. The stubs below (this script only) make it run on CPU;
none of them touches the arithmetic: they replace stream/event bookkeeping that orders
asynchronous GPU work (on CPU with gloo every collective here completes before it returns)
and redirect two hard-coded CUDA allocations to the CPU.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/ -> reference_fixture

import reference_fixture as rf  # noqa: E402


# ----------------------------------------------------------------------------------------
# CUDA stubs (CPU only). Installed before megatron_fsdp is imported.
# ----------------------------------------------------------------------------------------
class _CpuEvent:
    """Replaces torch.cuda.Event (as returned by Stream.record_event()). The reference only
    calls .wait() on it to order later GPU work after a side-stream collective; on CPU the
    collective has already finished, so waiting is a no-op."""

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True


class _CpuStream:
    """Replaces torch.cuda.Stream / torch.cuda.current_stream(). The reference uses side
    streams only to overlap communication with compute; on CPU all work runs in program
    order on the calling thread, so wait_stream / record_event are pure no-ops and the
    values computed are the same as with a single stream."""

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return _CpuEvent()

    def synchronize(self):
        return None


def _install_cuda_stubs() -> None:
    # torch.cuda.Stream(): side streams created in MegatronFSDP.__init__ (and the reduce /
    # gather pipelines); see _CpuStream.
    torch.cuda.Stream = lambda *a, **k: _CpuStream()
    # torch.cuda.current_stream(): the "main" stream the side streams wait on; see _CpuStream.
    torch.cuda.current_stream = lambda *a, **k: _CpuStream()
    # `with torch.cuda.stream(s):` selects the stream kernels are queued on; on CPU there is
    # no queue, the body simply runs.
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    # (torch.cuda.empty_cache() is also called, but is already a no-op while CUDA is not
    # initialised; torch.cuda.synchronize() is not reached on this code path.)
    # torch.cuda.current_device(): used only to build the string "cuda:<idx>" that
    # MegatronFSDP compares with its `device` argument (we pass device=cpu explicitly; the
    # mismatch only logs a warning). On a CPU build the real call raises "Torch not compiled
    # with CUDA enabled". Returns 0; no tensor is ever allocated on that device (such an
    # allocation would fail loudly on a CPU build, so a silent change is impossible).
    torch.cuda.current_device = lambda: 0


def _patch_reference_after_import() -> None:
    import megatron_fsdp.uneven_dtensor as ud

    # uneven_dtensor: a tiny int tensor of "does my chunk touch the dim boundaries" flags is
    # moved with `.cuda()` so NCCL can all-reduce it (MAX). Replace the module's `torch`
    # with a proxy whose `tensor(...)` returns a CPU tensor whose .cuda() is the identity;
    # gloo all-reduces it on CPU. Only a metadata sanity check, no training numbers.
    class _NoCudaTensor(torch.Tensor):
        def cuda(self, *a, **k):  # identity on CPU
            return self.as_subclass(torch.Tensor)

    class _TorchProxy:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def tensor(*a, **k):
            return torch.tensor(*a, **k).as_subclass(_NoCudaTensor)

    ud.torch = _TorchProxy()


_install_cuda_stubs()

import megatron_fsdp  # noqa: E402
from megatron_fsdp import fully_shard  # noqa: E402

_patch_reference_after_import()


def _param_order_names(model, optimizer) -> list[str]:
    """Names (in model.named_parameters() of the wrapper) of the optimizer's params,
    in the optimizer's order (the integer ids of optimizer.state_dict()["state"])."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    names, seen = [], set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen:
                continue
            seen.add(id(p))
            names.append(by_id.get(id(p), f"<unnamed {tuple(p.shape)}>"))
    return names


def build_sharded(kind: str, world: int):
    """The toy model and optimizer ``kind``, sharded by the reference's ``fully_shard``
    (ZeRO-3, ``fsdp_unit_modules=[Block]``, ``preproc_state_dict_for_dcp_ckpt=True``,
    ``world``-rank DP mesh), with the CPU adjustments below. Returns (model, optimizer)
    ready for step 1. Also used by resume_reference.py."""
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_shard_cp", "tp"))
    module = rf.make_model(seed=0)
    optimizer = rf.make_optimizer(module.parameters(), kind)
    # fully_shard() -> fully_shard_optimizer() runs one "non-lazy state init"
    # optimizer.step() with all-zero gradients (so DCP can load into a fresh optimizer).
    # For AdamW that step is not a no-op: it applies decoupled weight decay once to the
    # main weights and leaves state step=1, so the reference curve becomes that of plain
    # torch with one extra zero-gradient step (verified: rel. diff 1.2e-2 at step 4,
    # reproduced exactly in plain torch). To match one_process_losses we make the init
    # step an exact no-op: lr=0 while fully_shard() runs (fully_shard rebuilds the single
    # param group from optimizer.defaults), then restore lr and zero the state it created
    # in place (keeps the reference's state layout; a zero state behaves exactly like a
    # fresh one: Adam's step counter restarts at 1, SGD's momentum 0*0.9+g = g).
    real_lr = optimizer.defaults["lr"]
    optimizer.defaults["lr"] = 0.0
    model, optimizer = fully_shard(
        module,
        optimizer,
        device_mesh=mesh,
        dp_shard_dim="dp_shard_cp",
        tp_dim="tp",
        fsdp_unit_modules=[rf.Block],
        zero_dp_strategy=3,
        preproc_state_dict_for_dcp_ckpt=True,
        device=torch.device("cpu"),
    )
    # Gloo has no ReduceOp.PREMUL_SUM (NCCL's fused "scale then sum" reduce). Turn off the
    # reference's `gradient_reduce_div_fusion` so that it takes its own unfused branch of
    # gradient_reduce_preprocessing(): grad.mul_(1/dp_size) then a SUM reduce-scatter -- the
    # same per-rank products summed, i.e. the same gradient average.
    assert model.param_and_grad_buffer.ddp_config is model.ddp_config
    model.ddp_config.gradient_reduce_div_fusion = False

    optimizer.defaults["lr"] = real_lr
    for group in optimizer.param_groups:
        group["lr"] = real_lr
    with torch.no_grad():
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    value.zero_()
    return model, optimizer


def run_kind(kind: str, rank: int, world: int, out_dir: Path) -> dict:
    model, optimizer = build_sharded(kind, world)
    losses = rf.train_steps(model, optimizer, range(1, rf.SAVE_AT + 1), rank, world)

    # Per-rank view: local shard shape of every parameter and which optimizer-state
    # indices exist on this rank (the reference creates no state for empty local shards).
    order = _param_order_names(model, optimizer)
    local = {
        "local_shard_shapes": {
            n: list(p.to_local().shape if hasattr(p, "to_local") else p.shape)
            for n, p in model.named_parameters()
        },
        "optimizer_state_indices": sorted(
            order.index(n) for n, p in model.named_parameters() if p in optimizer.state
        ),
    }
    per_rank = [None] * world
    dist.all_gather_object(per_rank, local)

    ckpt = out_dir / kind
    if rank == 0 and ckpt.exists():
        shutil.rmtree(ckpt)
    dist.barrier()
    dcp.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
        checkpoint_id=str(ckpt),
    )
    dist.barrier()
    return {
        "losses": losses,
        "optimizer_param_order": order,
        "per_rank": per_rank,
        "inner_module_named_parameters": [n for n, _ in model.module.named_parameters()],
        "wrapper_named_parameters": [n for n, _ in model.named_parameters()],
    }


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "the fixture is defined for 2 ranks"
    torch.use_deterministic_algorithms(True)

    record = {
        "reference": "megatron-fsdp",
        "reference_version": megatron_fsdp.__version__,
        "torch_version": torch.__version__,
        "world_size": world,
        "zero_dp_strategy": 3,
        "fsdp_unit_modules": ["Block"],
        "save_at": rf.SAVE_AT,
        "total": rf.TOTAL,
        "state_dict": '{"model": model.state_dict(), "optimizer": optimizer.state_dict()}',
        "how_it_was_made": (
            "/tmp/ref_venv/bin/torchrun --standalone --nproc-per-node 2 "
            "tests/data/megatron_fsdp_0_6_1/make_fixture.py  (gloo, CPU, CUDA stream/event "
            "calls stubbed; see README.md)"
        ),
        "deviations_from_plain_reference": [
            "CUDA stream/event/current_device calls stubbed for CPU (no numeric effect)",
            "gradient_reduce_div_fusion=False (gloo lacks PREMUL_SUM; same average)",
            "fully_shard_optimizer's zero-grad state-init step made a no-op (lr=0 during "
            "fully_shard, then state zeroed) so AdamW matches plain torch; saved step == 4",
        ],
        "kinds": {},
    }
    for kind in rf.KINDS:
        info = run_kind(kind, rank, world, HERE)
        expected = rf.one_process_losses(kind, rf.SAVE_AT)
        rel = max(
            abs(a - b) / max(abs(b), 1e-12) for a, b in zip(info["losses"], expected, strict=True)
        )
        info["one_process_losses"] = expected
        info["max_rel_diff_vs_one_process"] = rel
        if rank == 0:
            print(
                f"[{kind}] reference {info['losses']}\n[{kind}] one-proc  {expected}\n"
                f"[{kind}] max rel diff {rel:.3e}",
                flush=True,
            )
        if rel > 1e-5:
            raise SystemExit(f"{kind}: reference losses differ from one_process_losses ({rel})")
        record["kinds"][kind] = info

    if rank == 0:
        (HERE / "writer.json").write_text(json.dumps(record, indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
