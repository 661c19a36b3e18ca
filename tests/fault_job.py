"""A torchrun job whose rank 1 is SIGKILLed at its third step (test_reliability_faults)."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

from megatron_fsdp import fully_shard_model, fully_shard_optimizer
from mfsdp_hooks.testing import Block, local_slice, loss_fn, make_batches, make_model


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = fully_shard_model(make_model(), [Block])
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step, (tokens, targets) in enumerate(make_batches(10, 4)):
        if step == 2 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = loss_fn(model(local_slice(tokens, rank, world)), local_slice(targets, rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
