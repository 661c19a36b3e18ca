"""Mistakes in megatron_fsdp's entry points raise an error that names the argument and the fix,
on every rank, before any collective is issued. One world of two ranks tries every case."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp import (
    DistributedDataParallelConfig,
    FSDPDistributedIndex,
    MegatronFSDP,
    MixedPrecisionPolicy,
    fully_shard,
    fully_shard_model,
)
from mfsdp_collectives import CommTracer
from mfsdp_collectives.testing import run_distributed


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def _model(**options: Any) -> Callable[[], object]:
    return lambda: fully_shard_model(nn.Sequential(Block(), Block()), [Block], **options)


def _class(**options: Any) -> Callable[[], object]:
    return lambda: MegatronFSDP(nn.Sequential(Block()), fsdp_unit_modules=[Block], **options)


def _cases(mesh: Any, mesh_2d: Any) -> dict[str, Callable[[], object]]:
    index = FSDPDistributedIndex(mesh, dp_shard_dim="dp")
    return {
        "optimizer": lambda: fully_shard(nn.Sequential(Block()), "adam"),  # type: ignore[arg-type]
        "module": lambda: fully_shard_model("net", [Block]),  # type: ignore[arg-type]
        "tp_dim": _model(tp_dim="tp"),
        "dp_shard_dim": _model(dp_shard_dim="dp"),
        "device_mesh": _model(device_mesh="mesh"),
        "2d_mesh": _model(device_mesh=mesh_2d),
        "policy": _model(mixed_precision_policy="bf16"),
        "policy_and_legacy": _model(
            mixed_precision_policy=MixedPrecisionPolicy(), grad_reduce_in_fp32=True
        ),
        "strategy": _model(zero_dp_strategy=True),
        "outer_without_group": _model(dp_outer_dim="outer"),
        "outer_without_mesh": _model(dp_outer_dim="outer", hybrid_fsdp_group=dist.group.WORLD),
        "hybrid_group": _model(
            device_mesh=mesh_2d,
            dp_shard_dim="shard",
            dp_outer_dim="outer",
            hybrid_fsdp_group="group",
        ),
        "expert_mesh": _model(expt_device_mesh="mesh"),
        "index_dim": lambda: FSDPDistributedIndex(mesh),
        "dist_index": _class(dist_index="index"),
        "ddp_config": _class(dist_index=index, ddp_config={"grad_reduce_in_fp32": True}),
        "ddp_config_precision": _class(
            dist_index=index,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, megatron_fsdp_grad_comm_dtype=torch.bfloat16
            ),
        ),
    }


def _worker(rank: int, world: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    mesh_2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("outer", "shard"))
    messages = {}
    for case, call in _cases(mesh, mesh_2d).items():
        with CommTracer() as tracer:
            try:
                call()
                messages[case] = "no error"
            except (ValueError, TypeError) as error:
                messages[case] = f"{type(error).__name__}: {error}"
        assert tracer.records == [], f"{case}: a collective ran before the error"
    return messages


EXPECTED = {
    "optimizer": "TypeError: optimizer must be a torch.optim.Optimizer, got str",
    "module": "TypeError: module must be an nn.Module, got str",
    "tp_dim": "ValueError: tp_dim='tp' was given without device_mesh: pass the mesh",
    "dp_shard_dim": "ValueError: dp_shard_dim='dp' was given without device_mesh: pass the mesh",
    "device_mesh": "TypeError: device_mesh must be a DeviceMesh, got str",
    "2d_mesh": "ValueError: dp_shard_dim is required with a 2-D device_mesh ('outer', 'shard')",
    "policy": "TypeError: mixed_precision_policy must be a megatron_fsdp.MixedPrecisionPolicy",
    "policy_and_legacy": "ValueError: mixed_precision_policy was given together with "
    "grad_reduce_in_fp32/preserve_fp32_weights: set reduce_dtype/main_params_dtype",
    "strategy": "TypeError: zero_dp_strategy must be an int 0-3 or a strategy name, got True",
    "outer_without_group": "ValueError: dp_outer_dim was given without hybrid_fsdp_group",
    "outer_without_mesh": "ValueError: dp_outer_dim needs device_mesh: pass the mesh",
    "hybrid_group": "TypeError: hybrid_fsdp_group must be a ProcessGroup, got str",
    "expert_mesh": "TypeError: expt_device_mesh must be a DeviceMesh, got str",
    "dist_index": "TypeError: dist_index must be a megatron_fsdp.FSDPDistributedIndex, got str",
    "ddp_config": "TypeError: ddp_config must be a megatron_fsdp.DistributedDataParallelConfig",
    "index_dim": "ValueError: dp_shard_dim=None names no dim of device_mesh (dims ['dp'])",
    "ddp_config_precision": "ValueError: DistributedDataParallelConfig: set either "
    "grad_reduce_in_fp32/preserve_fp32_weights or the megatron_fsdp_*_dtype fields, not both",
}


def test_bad_input_is_named_on_every_rank_before_any_collective() -> None:
    for messages in run_distributed(_worker, 2, timeout=120):
        assert messages.keys() == EXPECTED.keys()
        wrong = {c: m for c, m in messages.items() if not m.startswith(EXPECTED[c])}
        assert not wrong, wrong
