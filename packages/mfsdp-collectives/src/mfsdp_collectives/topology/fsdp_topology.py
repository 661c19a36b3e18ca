"""Which process groups FSDP shards and replicates over, and on which device: from a
``DeviceMesh``, explicit process groups, or the default world mesh, in one place so every
layer agrees on what "the shard group" is.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..core._compat import concatenate_meshes
from ..core.fake import real_tensors
from ..core.naming import group_name, register_group_name
from ..host.host_transport import check_host_transport, enable_host_transport, host_transport_of
from ..host.shm import SharedMemoryTransport
from .optim_sharding import OptimizerSharding

__all__ = ["FSDPTopology", "default_device", "group_name", "init_default_group"]

DP_SHARD = "dp_shard"
DP_OUTER = "dp_outer"
TP = "tp"

# The wing's name, not the module's: the one users filter on and read in the log line.
_log = logging.getLogger("mfsdp_collectives.topology")

# What torchrun (and torch.distributed.launch, SLURM wrappers that mimic it) exports, and
# what init_process_group's env:// rendezvous reads.
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def default_device() -> torch.device:
    """The current accelerator device when there is one, else CPU."""
    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return torch.device("cpu") if accel is None else _device_for_type(accel.type)


def mesh_has_dim(mesh: DeviceMesh, dim: str) -> bool:
    """A dim of the mesh, or a flattened one (``mesh[("dp_shard", "cp")]._flatten(
    "dp_shard_cp")`` registers ``"dp_shard_cp"`` on the root mesh for context parallelism)."""
    if dim in (mesh.mesh_dim_names or ()):
        return True
    try:
        mesh[dim]
    except (KeyError, RuntimeError, ValueError):
        return False
    return True


def _device_for_type(device_type: str) -> torch.device:
    """A concrete device (with index) for a mesh's device type on this rank."""
    if device_type == "cpu":
        return torch.device("cpu")
    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accel is not None and accel.type == device_type:
        return torch.device(device_type, torch.accelerator.current_device_index())
    return torch.device(device_type)


def _as_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return default_device()
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(
                f"device={device!r} is not a valid torch device string; "
                "pass e.g. 'cpu' or a torch.device"
            ) from exc
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, a string or None, got {type(device)}")
    if device.type != "cpu" and device.index is None:
        return _device_for_type(device.type)
    return device


def _check_group(value: object, arg: str, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, dist.ProcessGroup):
        expected = "a ProcessGroup or None" if optional else "a ProcessGroup"
        raise TypeError(f"{arg} must be {expected}, got {type(value).__name__}")


def _backend_for(device: torch.device) -> str:
    """gloo for a CPU model; on an accelerator its backend (nccl on CUDA) with gloo beside it
    for CPU tensors, as ``init_process_group()`` without a backend gives."""
    if device.type == "cpu":
        return "gloo"
    return f"cpu:gloo,{device.type}:{dist.get_default_backend_for_device(device)}"


def init_default_group(device: torch.device) -> None:
    """Initialise torch.distributed's default group from a launcher's environment, as FSDP2's
    ``init_device_mesh`` does, so a script that only calls ``fully_shard`` runs under torchrun."""
    if dist.is_initialized():
        return
    missing = [name for name in _LAUNCHER_ENV if name not in os.environ]
    if missing:
        raise RuntimeError(
            "fully_shard needs torch.distributed's default process group: none is initialised "
            f"and the launcher's environment variables {missing} are not set. Launch the script "
            "with torchrun (torchrun --nproc-per-node=N train.py), or call "
            f"torch.distributed.init_process_group(backend={_backend_for(device)!r}) before "
            "wrapping the model"
        )
    backend = _backend_for(device)
    dist.init_process_group(backend=backend)
    _log.info(
        "initialised torch.distributed's default process group from the launcher's "
        "environment (backend %r, rank %d of %d): no process group was initialised before "
        "fully_shard",
        backend,
        dist.get_rank(),
        dist.get_world_size(),
    )


def _name_groups(shard: dist.ProcessGroup, *others: dist.ProcessGroup | None) -> None:
    """The tracer's names: ``dp_shard``, and ``dp_outer`` and ``tp`` for those given."""
    for group, name in zip((shard, *others), (DP_SHARD, DP_OUTER, TP), strict=True):
        if group is not None:
            register_group_name(group, name)


@dataclass
class FSDPTopology:
    """The groups FSDP communicates over, plus the device its buffers live on: ``shard_group``
    shards, ``outer_group`` (HSDP) replicates, ``tp_group`` is carried for upper layers,
    ``shard_mesh`` is the sharded dim's 1-D mesh, ``optim_sharding`` is HFSDP's cut."""

    shard_group: dist.ProcessGroup
    outer_group: dist.ProcessGroup | None
    tp_group: dist.ProcessGroup | None
    device: torch.device
    shard_mesh: DeviceMesh | None = None
    mesh: DeviceMesh | None = None
    # How the shard group's CPU all-gathers and reduce-scatters travel, chosen once by
    # ``with_host_transport``: the shared-memory transport, or None for c10d.
    host_transport: SharedMemoryTransport | None = None
    tp_mesh: DeviceMesh | None = None
    """The ``tp_dim`` submesh (``from_mesh``): Megatron-style TP parameters are cut over it."""
    outer_mesh: DeviceMesh | None = None
    """The ``dp_outer_dim`` submesh (``from_mesh``): HFSDP joins it with ``shard_mesh`` for TP."""
    optim_sharding: OptimizerSharding | None = None
    # HFSDP: how the reduce-scatter and all-gather across dp_outer travel (chosen likewise).
    outer_transport: SharedMemoryTransport | None = None

    def with_host_transport(self, choice: str) -> FSDPTopology:
        """This topology with its CPU transports chosen (``"auto"``, ``"shm"``, ``"gloo"``; see
        ``enable_host_transport``): the shard group's, and under HFSDP the outer group's.
        A new topology; this one is left as it is. Collective over the groups unless
        ``"gloo"``; on accelerators there is nothing to choose and this topology is returned."""
        check_host_transport(choice)
        if self.device.type != "cpu":
            return self
        outer = self.outer_group if self.shards_optimizer_across_outer else None
        groups = [g for g in (self.shard_group, outer) if g is not None]
        if choice == "gloo" and any(host_transport_of(g) is not None for g in groups):
            raise ValueError(
                "host_transport='gloo', but an earlier fully_shard already put this shard "
                "group's collectives on shared memory; pass a mesh over a separate process "
                "group for this model, or the same host_transport as before"
            )
        return dataclasses.replace(
            self,
            host_transport=enable_host_transport(self.shard_group, choice),
            outer_transport=None if outer is None else enable_host_transport(outer, choice),
        )

    @property
    def shard_rank(self) -> int:
        return dist.get_rank(self.shard_group)

    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.shard_group)

    @property
    def outer_rank(self) -> int:
        return 0 if self.outer_group is None else dist.get_rank(self.outer_group)

    @property
    def outer_size(self) -> int:
        return 1 if self.outer_group is None else dist.get_world_size(self.outer_group)

    @property
    def is_hsdp(self) -> bool:
        return self.outer_group is not None

    @property
    def shards_optimizer_across_outer(self) -> bool:
        """HFSDP: main weights, gradients and optimizer state are 1/(shard x outer)."""
        return self.optim_sharding is not None

    @property
    def optim_group(self) -> dist.ProcessGroup:
        """The ranks the optimizer-facing shards partition (each holds one of them)."""
        sharding = self.optim_sharding
        return self.shard_group if sharding is None else sharding.group

    @property
    def optim_rank(self) -> int:
        """Which optimizer-facing shard of the flat buffer this rank holds."""
        sharding = self.optim_sharding
        return self.shard_rank if sharding is None else sharding.index

    @property
    def optim_size(self) -> int:
        sharding = self.optim_sharding
        return self.shard_size if sharding is None else sharding.size

    @property
    def optim_mesh(self) -> DeviceMesh | None:
        """The 1-D mesh of the distributed parameters' DTensors."""
        sharding = self.optim_sharding
        return self.shard_mesh if sharding is None else sharding.mesh

    def with_tp(self, tp_mesh: DeviceMesh) -> DeviceMesh:
        """The 2-D ``(dp, tp)`` mesh of a tensor-parallel parameter's DTensors: the optimizer
        mesh joined with its TP mesh. Under HFSDP the dp dim is the user mesh's
        ``(dp_outer, dp_shard)`` flattened (README; a collective over the mesh the first time),
        mapped by ``optim_indices_along``."""
        if self.shards_optimizer_across_outer:
            return concatenate_meshes([self._hfsdp_dp_mesh(), tp_mesh])
        if self.optim_mesh is None:
            raise NotImplementedError(
                "tensor-parallel parameters need a DP mesh from the same DeviceMesh as their TP "
                "mesh: pass the mesh's dp_shard dim"
            )
        return concatenate_meshes([self.optim_mesh, tp_mesh])

    def _hfsdp_dp_mesh(self) -> DeviceMesh:
        sharding = self.optim_sharding
        assert sharding is not None
        if self.outer_mesh is None or self.shard_mesh is None or self.mesh is None:
            raise NotImplementedError(
                "HFSDP with tensor-parallel parameters needs the topology built from the "
                "DeviceMesh holding dp_outer, dp_shard and tp (FSDPTopology.from_mesh), not "
                "from process groups"
            )
        return sharding.flattened_mesh(self.outer_mesh, self.shard_mesh)

    def optim_indices_along(self, mesh: DeviceMesh) -> tuple[int, ...]:
        """The optimizer-facing shard held at each coordinate of ``mesh``'s dim 0 (this rank's
        coordinates on the other dims): the optimizer mesh or a ``with_tp`` mesh."""
        sharding = self.optim_sharding
        return tuple(range(mesh.size(0))) if sharding is None else sharding.indices_along(mesh)

    def optim_index_of(self, group_rank: int) -> int:
        """The optimizer-facing shard held by rank ``group_rank`` of ``optim_group``."""
        sharding = self.optim_sharding
        return group_rank if sharding is None else sharding.index_of_group_rank[group_rank]

    def shard_optimizer_across_outer(self, group: dist.ProcessGroup) -> None:
        """Turn HSDP into HFSDP: ``group`` holds the ranks of the flattened (dp_outer,
        dp_shard) submesh, over which main weights, gradients and optimizer state are cut.
        Collective over ``group``."""
        _check_group(group, "hybrid_fsdp_group", optional=False)
        if self.outer_group is None:
            raise ValueError(
                "sharding the optimizer across dp_outer (HFSDP) needs an outer group: build "
                "the topology with dp_outer_dim (or outer_group) first"
            )
        self.optim_sharding = OptimizerSharding.across_outer(
            group,
            shard_rank=self.shard_rank,
            shard_size=self.shard_size,
            outer_rank=self.outer_rank,
            outer_size=self.outer_size,
            device_type=self.device.type,
        )

    @classmethod
    def from_mesh(
        cls,
        mesh: DeviceMesh,
        *,
        dp_shard_dim: str = DP_SHARD,
        dp_outer_dim: str | None = None,
        tp_dim: str | None = None,
    ) -> FSDPTopology:
        """Take the groups from named dims of ``mesh`` (names, not positions, so a user's
        ``("dp_outer", "dp_shard", "tp")`` mesh is read without guessing)."""
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
        names = tuple(mesh.mesh_dim_names or ())
        if not names:
            raise ValueError(
                "mesh has no mesh_dim_names; build it with "
                f"init_device_mesh(..., mesh_dim_names=({DP_SHARD!r}, ...))"
            )
        dims = {"dp_shard_dim": dp_shard_dim, "dp_outer_dim": dp_outer_dim, "tp_dim": tp_dim}
        for arg, dim in dims.items():
            if dim is not None and not mesh_has_dim(mesh, dim):
                raise ValueError(
                    f"{arg}={dim!r} is not a dimension of the mesh; the mesh has "
                    f"mesh_dim_names={list(names)}: pass one of them or rename the mesh dims"
                )
        used = [d for d in dims.values() if d is not None]
        if len(set(used)) != len(used):
            raise ValueError(
                f"dp_shard_dim, dp_outer_dim and tp_dim must name different mesh dims, got {dims}"
            )
        shard_group = mesh.get_group(dp_shard_dim)
        outer_group = None if dp_outer_dim is None else mesh.get_group(dp_outer_dim)
        tp_group = None if tp_dim is None else mesh.get_group(tp_dim)
        _name_groups(shard_group, outer_group, tp_group)
        return cls(
            shard_group=shard_group,
            outer_group=outer_group,
            tp_group=tp_group,
            device=_device_for_type(mesh.device_type),
            shard_mesh=mesh[dp_shard_dim] if mesh.ndim > 1 else mesh,
            mesh=mesh,
            tp_mesh=None if tp_dim is None else mesh[tp_dim],
            outer_mesh=None if dp_outer_dim is None else mesh[dp_outer_dim],
        )

    @classmethod
    def from_groups(
        cls,
        shard_group: dist.ProcessGroup,
        outer_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ) -> FSDPTopology:
        """Wrap explicit process groups (Megatron-style parallel state)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "FSDPTopology.from_groups needs torch.distributed to be initialised; call "
                "torch.distributed.init_process_group(...) first (or use torchrun)"
            )
        _check_group(shard_group, "shard_group", optional=False)
        _check_group(outer_group, "outer_group", optional=True)
        _check_group(tp_group, "tp_group", optional=True)
        if outer_group is not None and outer_group is shard_group:
            raise ValueError("outer_group must differ from shard_group; pass None for plain FSDP")
        dev = _as_device(device)
        _name_groups(shard_group, outer_group, tp_group)
        shard_mesh = DeviceMesh.from_group(shard_group, dev.type, mesh_dim_names=(DP_SHARD,))
        return cls(
            shard_group=shard_group,
            outer_group=outer_group,
            tp_group=tp_group,
            device=dev,
            shard_mesh=shard_mesh,
            mesh=None,
        )

    @classmethod
    def default(cls, device: torch.device | str | None = None) -> FSDPTopology:
        """Plain FSDP over the whole world: a 1-D ``"dp_shard"`` mesh on ``device``'s type
        (initialising the default group from a launcher's environment if need be)."""
        dev = _as_device(device)
        init_default_group(dev)
        with real_tensors():  # under FakeTensorMode (a planning run) too
            mesh = init_device_mesh(dev.type, (dist.get_world_size(),), mesh_dim_names=(DP_SHARD,))
        return dataclasses.replace(cls.from_mesh(mesh, dp_shard_dim=DP_SHARD), device=dev)
