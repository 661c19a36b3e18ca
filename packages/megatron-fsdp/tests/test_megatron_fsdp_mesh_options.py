"""``fully_shard_model``'s mesh arguments resolve through the engine's one reading of a mesh
(``mfsdp_hooks.resolve_topology``), and its group-size rule is the engine's (ZeRO-3 only), in
Megatron's argument names. Two ranks, ``sharding_options`` only: no model is sharded."""

from __future__ import annotations

from typing import Any

from mfsdp_collectives.testing import run_distributed


def _worker(rank: int, world: int) -> dict[str, Any]:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_fsdp.engine_options import sharding_options
    from mfsdp_collectives import FSDPTopology

    out: dict[str, Any] = {}
    for label, names in (("named", ("dp",)), ("unnamed", None)):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=names)
        options = sharding_options(nn.Linear(2, 2), [nn.Linear], device_mesh=mesh)
        topology = options.device_mesh
        assert isinstance(topology, FSDPTopology)
        out[label] = (topology.shard_size, topology.shard_rank)
    try:
        sharding_options(
            nn.Linear(2, 2), [nn.Linear], zero_dp_strategy=2, reshard_after_forward_group_size=2
        )
    except ValueError as error:
        out["refusal"] = str(error)
    return out


def test_a_1d_device_mesh_named_or_not_is_the_engines_reading() -> None:
    for rank, answer in enumerate(run_distributed(_worker, 2, timeout=60)):
        assert answer["named"] == (2, rank)
        assert answer["unnamed"] == (2, rank)  # FSDP2's init_device_mesh("cpu", (world,))
        assert answer["refusal"] == (
            "reshard_after_forward_group_size=2 with zero_dp_strategy=2: only ZeRO-3 reshards "
            "weights after forward; pass zero_dp_strategy=3 or leave it None"
        )
