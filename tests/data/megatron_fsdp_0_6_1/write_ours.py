"""Write the toy run's SAVE_AT checkpoint with our library, named for NVIDIA megatron-fsdp.

Run (our venv; any world size that divides 12 rows):

    torchrun --standalone --nproc-per-node 3 \\
        tests/data/megatron_fsdp_0_6_1/write_ours.py --kind sgd --out /tmp/ours_sgd

then resume it with the reference (resume_reference.py --checkpoint /tmp/ours_sgd, in the
reference's venv). ``nox -s reference`` runs both for SGD and AdamW.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.distributed as dist

import megatron_fsdp
import mfsdp_checkpoint as mc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ -> reference_fixture
import reference_fixture as rf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=rf.KINDS, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    module = rf.make_model(0)
    model, optimizer = megatron_fsdp.fully_shard(
        module,
        rf.make_optimizer(module.parameters(), args.kind),
        fsdp_unit_modules=[rf.Block],
        zero_dp_strategy=3,
    )
    losses = rf.train_steps(model, optimizer, range(1, rf.SAVE_AT + 1), rank, world)
    mc.save_checkpoint(args.out, model, optimizer, naming="nvidia")
    if rank == 0:
        expected = rf.one_process_losses(args.kind, rf.SAVE_AT)
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, expected, strict=True))
        print(f"[{args.kind}] ours {losses}, max rel diff to one process {rel:.3e}", flush=True)
        print(f"[{args.kind}] saved {args.out}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
