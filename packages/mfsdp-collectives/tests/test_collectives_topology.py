"""Building the topology from a mesh, from groups, and by default; group names."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mfsdp_collectives import FSDPTopology, default_device, group_name, register_group_name
from mfsdp_collectives.testing import run_distributed


def _topology_world(rank: int, ws: int) -> list[str]:
    names = []
    # default(): a 1-D "dp_shard" mesh over the world on the CPU
    topo = FSDPTopology.default("cpu")
    assert topo.device == torch.device("cpu")
    assert (topo.shard_rank, topo.shard_size) == (rank, ws)
    assert (topo.outer_rank, topo.outer_size) == (0, 1) and not topo.is_hsdp
    assert topo.outer_group is None and topo.tp_group is None
    assert topo.mesh is not None and topo.mesh.mesh_dim_names == ("dp_shard",)
    assert topo.shard_mesh is topo.mesh
    names.append(group_name(topo.shard_group))

    # from_mesh with a missing dim names the dim and lists the mesh's dims
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match=r"dp_shard_dim='dp_shard'.*\['dp'\]"):
        FSDPTopology.from_mesh(mesh)
    with pytest.raises(ValueError, match=r"dp_outer_dim='outer'.*\['dp'\]"):
        FSDPTopology.from_mesh(mesh, dp_shard_dim="dp", dp_outer_dim="outer")
    with pytest.raises(ValueError, match="different mesh dims"):
        FSDPTopology.from_mesh(mesh, dp_shard_dim="dp", dp_outer_dim="dp")
    with pytest.raises(ValueError, match="mesh_dim_names"):
        FSDPTopology.from_mesh(init_device_mesh("cpu", (ws,)))
    with pytest.raises(TypeError, match="DeviceMesh"):
        FSDPTopology.from_mesh("dp_shard")  # type: ignore[arg-type]
    topo = FSDPTopology.from_mesh(mesh, dp_shard_dim="dp")
    assert topo.shard_size == ws

    # from_groups: explicit groups (Megatron style)
    pg = dist.new_group(list(range(ws)))
    with pytest.raises(TypeError, match="shard_group"):
        FSDPTopology.from_groups(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outer_group must differ"):
        FSDPTopology.from_groups(pg, outer_group=pg)
    with pytest.raises(ValueError, match="device="):
        FSDPTopology.from_groups(pg, device="not-a-device")
    topo = FSDPTopology.from_groups(pg, device="cpu")
    assert topo.shard_group is pg and topo.shard_size == ws and topo.mesh is None
    assert topo.shard_mesh is not None and topo.shard_mesh.size() == ws
    names.append(group_name(pg))

    # unnamed groups are named by their ranks
    other = dist.new_group(list(range(ws)))
    names.append(group_name(other))
    register_group_name(other, "custom")
    names.append(group_name(other))
    with pytest.raises(ValueError, match="non-empty"):
        register_group_name(other, "")
    return names


def test_topology_entry_points_and_names() -> None:
    results = run_distributed(_topology_world, 2, timeout=90)
    assert results == [["dp_shard", "dp_shard", "pg[0,1]", "custom"]] * 2


def test_default_device_without_accelerator() -> None:
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present: default_device() is not the CPU")
    assert default_device() == torch.device("cpu")


def test_topology_needs_initialised_distributed() -> None:
    if dist.is_initialized():
        pytest.skip("the test process itself has a process group")
    with pytest.raises(RuntimeError, match="init_process_group"):
        FSDPTopology.default("cpu")
