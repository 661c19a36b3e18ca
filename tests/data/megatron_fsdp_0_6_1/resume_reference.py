"""Resume the toy run with NVIDIA's megatron-fsdp 0.6.1 from a DCP checkpoint.

Run (CPU, gloo, in the venv of make_fixture.py: NVIDIA's megatron-fsdp 0.6.1 and NOT our
packages; see README.md next to this file):

    /tmp/ref_venv/bin/torchrun --standalone --nproc-per-node 2 \\
        tests/data/megatron_fsdp_0_6_1/resume_reference.py \\
        --kind sgd --checkpoint DIR --losses-out FILE.json

It installs make_fixture.py's CPU stubs (by importing it), builds and shards the toy model and
optimizer exactly as make_fixture.py does (``build_sharded``), loads ``DIR`` the way the
reference README resumes::

    ckpt_state_dict = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.distributed.checkpoint.load(state_dict=ckpt_state_dict, checkpoint_id=str(DIR))
    model.load_state_dict(ckpt_state_dict["model"], strict=False)
    optimizer.load_state_dict(ckpt_state_dict["optimizer"])

then trains steps ``SAVE_AT + 1 .. TOTAL`` on ``local_batch(step, rank, 2)`` and writes the
per-step losses (mean over ranks) to ``--losses-out`` as a JSON list. A correct resume gives
``one_process_losses(kind, TOTAL)[SAVE_AT:]``; the script reports the max relative difference
and exits non-zero when it exceeds 1e-5.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import make_fixture as mf  # installs the CPU stubs and imports the reference
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

rf = mf.rf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=rf.KINDS, required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--losses-out", type=Path, required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "the reference resume is defined for 2 ranks"
    torch.use_deterministic_algorithms(True)

    model, optimizer = mf.build_sharded(args.kind, world)

    # The reference README's resume.
    ckpt_state_dict = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state_dict=ckpt_state_dict, checkpoint_id=str(args.checkpoint))
    model.load_state_dict(ckpt_state_dict["model"], strict=False)
    optimizer.load_state_dict(ckpt_state_dict["optimizer"])

    losses = rf.train_steps(model, optimizer, range(rf.SAVE_AT + 1, rf.TOTAL + 1), rank, world)

    if rank == 0:
        expected = rf.one_process_losses(args.kind, rf.TOTAL)[rf.SAVE_AT :]
        rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, expected, strict=True))
        print(
            f"[{args.kind}] resumed  {losses}\n[{args.kind}] one-proc {expected}\n"
            f"[{args.kind}] max rel diff {rel:.3e}",
            flush=True,
        )
        args.losses_out.parent.mkdir(parents=True, exist_ok=True)
        args.losses_out.write_text(json.dumps(losses) + "\n")
    else:
        rel = 0.0
    dist.barrier()
    dist.destroy_process_group()
    if rel > 1e-5:
        raise SystemExit(f"the resumed curve is off the one-process curve by {rel:.3e} (> 1e-5)")


if __name__ == "__main__":
    main()
