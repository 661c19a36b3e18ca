"""DDP around a model we sharded is refused with the fix (issue 49, item 4).

A plain ``accelerate.Accelerator().prepare(model)`` over several processes wraps the model in
torch's ``DistributedDataParallel``, which on a sharded model dies in its first broadcast with
"shape '[2048]' is invalid for input of size 4096". Each entry point's model (the seed API's
``MegatronFSDP``, the per-module ``fully_shard`` root) must instead raise, on every rank and
before any collective, an error naming ``MegatronFSDPAccelerator``; the model still trains
after it, and so does a plain ``DistributedDataParallel`` of an unsharded model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from toy_entry_points import shard_toy

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing import local_slice, loss_fn, make_batches

pytest.importorskip("accelerate")

_FIX = "megatron_fsdp.integrations.accelerate.MegatronFSDPAccelerator"


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters())


def _refused(rank: int, world: int) -> dict[str, Any]:
    from accelerate import Accelerator

    said: dict[str, Any] = {}
    accelerator = Accelerator(cpu=True)
    said["type"] = str(accelerator.distributed_type)
    for api in ("seed", "per_module"):
        model, optimizer = shard_toy(api, world, _adamw)
        for how in ("accelerate", "ddp"):
            try:
                if how == "accelerate":
                    accelerator.prepare(model)
                else:
                    torch.nn.parallel.DistributedDataParallel(model)
                said[f"{api} {how}"] = "not refused"
            except TypeError as error:
                said[f"{api} {how}"] = str(error)
        # No collective was left half-issued: the ranks still pair up and train.
        tokens, targets = make_batches(1)[0]
        loss = loss_fn(model(local_slice(tokens, rank, world)), local_slice(targets, rank, world))
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        said[f"{api} trained"] = bool(torch.isfinite(total))
    return said


def test_ddp_or_a_plain_accelerator_over_a_sharded_model_names_the_fix() -> None:
    for said in run_distributed(_refused, 2, timeout=90):
        assert said["type"] == "DistributedType.MULTI_CPU", said
        for api in ("seed", "per_module"):
            for how in ("accelerate", "ddp"):
                message = said[f"{api} {how}"]
                assert message.startswith("DistributedDataParallel("), said
                assert "is sharded by megatron-fsdp" in message and _FIX in message, said
            assert said[f"{api} trained"], said
