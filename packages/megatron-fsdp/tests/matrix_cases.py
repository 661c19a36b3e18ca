"""The cells of the entry-point x feature matrix (``test_megatron_fsdp_matrix.py``).

A cell is (row, column): an entry point and a feature. ``cell_worker`` runs on every rank:
it builds the column's model and meshes, wraps them through the row's entry point, trains
``STEPS`` steps and returns the global loss of each step and the final full weights, or the
exception the wrap raised. ``reference_run`` trains the same model in one process on the
same global batches: the ground truth the test compares with.

Rows (entry points):

* ``seed``: ``megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[...], ...)``.
* ``model_optimizer``: ``fully_shard_model`` then ``fully_shard_optimizer``.
* ``class``: ``megatron_fsdp.MegatronFSDP(module, FSDPDistributedIndex(...),
  DistributedDataParallelConfig(...), fsdp_unit_modules=[...])``.
* ``per_module``: ``mfsdp_hooks.fully_shard`` on each block, then the root; a plain optimizer
  built afterwards on ``model.parameters()``.
* ``mcore``: ``megatron_fsdp.mcore.FullyShardedDataParallel`` with stand-ins for
  Megatron-Core's configs, driven as Megatron-Core's loop drives a model chunk
  (``zero_grad_buffer``, backward, ``finish_grad_sync``, ``scale_gradients``, a plain
  optimizer step, ``copy_main_weights_to_model_weights``, ``start_param_sync``).

Model families: ``toy`` (``mfsdp_hooks.testing.ToyModel``: tied embedding and head, a frozen
layer), ``tp`` (``mfsdp_hooks.testing.tp``), ``ep`` (``mfsdp_hooks.testing.moe``) and
``float8`` (``mfsdp_te.float8_testing``). Every toy cell carries the tie and the frozen layer;
the ``tied`` and ``frozen`` columns also assert them explicitly.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import ecosystem_cases
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy

import megatron_fsdp
import mfsdp_hooks
from megatron_fsdp import (
    DistributedDataParallelConfig,
    FSDPDistributedIndex,
    MixedPrecisionPolicy,
    fully_shard_model,
    fully_shard_optimizer,
)
from megatron_fsdp.mcore import FullyShardedDataParallel, MCoreFSDPModel
from mfsdp_checkpoint import gather_full_state_dict, load_checkpoint, save_checkpoint
from mfsdp_collectives import FSDPTopology
from mfsdp_collectives.counting_comms import (
    CountingAllGather,
    CountingReduceScatter,
    GradientRecorder,
)
from mfsdp_hooks import ExpertSharding
from mfsdp_hooks.testing import Block, ToyModel, loss_fn, make_batches, make_model
from mfsdp_hooks.testing.moe import MOE_OUT, MOE_WIDTH, NUM_EXPERTS, MoEBlock, moe_model
from mfsdp_hooks.testing.tp import TP_OUT, TP_WIDTH, MLPBlock, megatron_tp_model, tp_model

ROWS = ("seed", "model_optimizer", "class", "per_module", "mcore")
COLS = (
    "zero0",
    "zero1",
    "zero2",
    "zero3",
    "hsdp",
    "hfsdp",
    "hfsdp_tp",
    "tp_dtensor",
    "tp_megatron",
    "ep",
    "cp",
    "meta_init",
    "float8",
    "bf16",
    "no_sync",
    "recompute",
    "cpu_offload",
    "tied",
    "frozen",
    "dcp_resume",
    "to_device",
    "train_eval",
    "decoupled_grad",
    "fine_grained",
    "reshard_int",
    "comm_hooks",
    *ecosystem_cases.COLS,
)

STEPS = 10
SAVE_AFTER = 5  # dcp_resume: save after this many steps, resume a fresh model for the rest
LR = 1e-2
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

_FAMILY = {
    "tp_dtensor": "tp",
    "tp_megatron": "tp",
    "hfsdp_tp": "tp",
    "ep": "ep",
    "float8": "float8",
}
_WORLD = {
    "hsdp": 4,
    "hfsdp": 4,
    "hfsdp_tp": 4,
    "tp_dtensor": 4,
    "tp_megatron": 4,
    "ep": 4,
    "cp": 4,
    "reshard_int": 4,
}
_STRATEGY = {"zero0": 0, "zero1": 1, "zero2": 2}
_STRATEGY_NAME = {0: "no_shard", 1: "optim", 2: "optim_grads", 3: "optim_grads_params"}
_UNIT: dict[str, type[nn.Module]] = {"toy": Block, "tp": MLPBlock, "ep": MoEBlock}


def family(col: str) -> str:
    return _FAMILY.get(col, "toy")


def world_size(col: str) -> int:
    """Ranks a column needs: 4 for 2x2 meshes, 2 otherwise."""
    return _WORLD.get(col, 2)


def strategy(col: str) -> int:
    """The ZeRO strategy of a column (ZeRO-3 unless the column is about the strategy)."""
    return _STRATEGY.get(col, 3)


def micro_batches(col: str) -> int:
    return 2 if col == "no_sync" else 1


def _unit_class(col: str) -> type[nn.Module]:
    if family(col) == "float8":
        from mfsdp_te.float8_testing import Float8Block

        return Float8Block
    return _UNIT[family(col)]


# --------------------------------------------------------------------------- data
def global_batch(col: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole batch (what one process trains on)."""
    kind = family(col)
    if kind == "toy":
        # cp cuts the sequence over 2 ranks: 6 positions (the default 5 would not divide).
        return _toy_batches(6 if col == "cp" else 5)[step]
    gen = torch.Generator().manual_seed(step)
    if kind == "tp":
        return torch.randn(8, 4, TP_WIDTH, generator=gen), torch.randn(8, 4, TP_OUT, generator=gen)
    if kind == "ep":
        return torch.randn(16, MOE_WIDTH, generator=gen), torch.randn(16, MOE_OUT, generator=gen)
    from mfsdp_te.float8_testing import float8_batch

    return float8_batch(step)


_BATCHES: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def _toy_batches(seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if seq not in _BATCHES:
        _BATCHES[seq] = make_batches(STEPS, global_batch=12, seq=seq)
    return _BATCHES[seq]


def eval_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """train_eval: the batch evaluated under ``no_grad`` after every step."""
    return make_batches(1, global_batch=12, seq=5, seed=99)[0]


def batch_loss(col: str, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    if family(col) == "toy":
        return loss_fn(outputs, targets)
    return nn.functional.mse_loss(outputs, targets)


def shares_in_reference(col: str) -> int:
    """How many per-rank shares the one-process reference runs as micro-batches of their
    own: float8 scales activations per tensor and bf16 rounds each share's gradient before
    the fp32 reduction, so the reference must see what each rank computes."""
    return world_size(col) if col in ("float8", "bf16") else 1


# --------------------------------------------------------------------------- layout
@dataclass
class Layout:
    """A column's meshes and this rank's share of the data."""

    device_mesh: DeviceMesh | None = None
    dp_shard_dim: str | None = None
    dp_outer_dim: str | None = None
    tp_dim: str | None = None
    hybrid_group: dist.ProcessGroup | None = None
    outer_optim: bool = False
    expert_mesh: DeviceMesh | None = None
    per_module_mesh: DeviceMesh | FSDPTopology | None = None
    experts: ExpertSharding | None = None
    dp: tuple[int, int] = (0, 1)  # (rank, size) over the batch rows
    cp: tuple[int, int] = (0, 1)  # (rank, size) over the sequence
    tp_mesh: DeviceMesh | None = None


def make_layout(col: str, rank: int, world: int) -> Layout:
    if col in ("hsdp", "hfsdp"):
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_outer", "dp_shard"))
        per_module: DeviceMesh | FSDPTopology = mesh  # FSDP2's (replicate, shard) convention
        if col == "hfsdp":
            topology = FSDPTopology.from_mesh(
                mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer"
            )
            topology.shard_optimizer_across_outer(dist.group.WORLD)  # type: ignore[arg-type]
            per_module = topology
        return Layout(
            device_mesh=mesh,
            dp_shard_dim="dp_shard",
            dp_outer_dim="dp_outer",
            hybrid_group=dist.group.WORLD,
            outer_optim=col == "hfsdp",
            per_module_mesh=per_module,
            dp=(rank, world),
        )
    if col == "hfsdp_tp":
        return _hfsdp_tp_layout(world)
    if family(col) == "tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
        per_module = mesh["dp_shard"]  # DTensor TP: FSDP2's way, the 1-D DP mesh
        if col == "tp_megatron":  # plain local TP tensors: the engine needs the TP dim named
            per_module = FSDPTopology.from_mesh(mesh, dp_shard_dim="dp_shard", tp_dim="tp")
        return Layout(
            device_mesh=mesh,
            dp_shard_dim="dp_shard",
            tp_dim="tp",
            per_module_mesh=per_module,
            dp=(mesh["dp_shard"].get_local_rank(), world // 2),
            tp_mesh=mesh["tp"],
        )
    if col == "ep":
        dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        expert = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "ep"))
        experts = ExpertSharding(
            topology=FSDPTopology.from_mesh(expert, dp_shard_dim="dp_shard"), mean_over=world
        )
        return Layout(
            device_mesh=dense,
            dp_shard_dim="dp_shard",
            expert_mesh=expert,
            per_module_mesh=dense,
            experts=experts,
            dp=(rank, world),
        )
    if col == "cp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_shard", "cp"))
        flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return Layout(
            device_mesh=mesh,
            dp_shard_dim="dp_shard_cp",
            per_module_mesh=flat,
            dp=(mesh["dp_shard"].get_local_rank(), 2),
            cp=(mesh["cp"].get_local_rank(), world // 2),
        )
    return Layout(dp=(rank, world))


def _hfsdp_tp_layout(world: int) -> Layout:
    """(dp_outer=2, dp_shard, tp=2) with the optimizer sharded across dp_outer as well."""
    dims = ("dp_outer", "dp_shard", "tp")
    mesh = init_device_mesh("cpu", (2, world // 4, 2), mesh_dim_names=dims)
    dp_mesh = mesh["dp_outer", "dp_shard"]._flatten("dp")
    topology = FSDPTopology.from_mesh(
        mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", tp_dim="tp"
    )
    topology.shard_optimizer_across_outer(dp_mesh.get_group())
    return Layout(
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        dp_outer_dim="dp_outer",
        tp_dim="tp",
        hybrid_group=dp_mesh.get_group(),
        outer_optim=True,
        per_module_mesh=topology,
        dp=(dp_mesh.get_local_rank(), dp_mesh.size()),
        tp_mesh=mesh["tp"],
    )


def local_share(
    x: torch.Tensor, y: torch.Tensor, layout: Layout
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows (and, under cp, its part of the sequence) of a batch."""
    (dp_rank, dp_size), (cp_rank, cp_size) = layout.dp, layout.cp
    x, y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
    if cp_size > 1:
        x, y = x.chunk(cp_size, dim=1)[cp_rank], y.chunk(cp_size, dim=1)[cp_rank]
    return x, y


# --------------------------------------------------------------------------- models
def original_model(col: str, layout: Layout, seed: int = 0) -> nn.Module:
    """The column's model as the user builds it before wrapping (on every rank alike)."""
    kind = family(col)
    if kind == "tp":
        assert layout.tp_mesh is not None
        if col == "tp_megatron":
            return megatron_tp_model(layout.tp_mesh)
        return tp_model("mlp", layout.tp_mesh)
    if kind == "ep":
        assert layout.expert_mesh is not None
        return moe_model(layout.expert_mesh["ep"].get_group())
    if kind == "float8":
        from mfsdp_te.float8_testing import float8_model

        return float8_model()
    if col == "meta_init":
        with torch.device("meta"):
            return ToyModel()
    if col in ecosystem_cases.MODEL_COLS:
        return ecosystem_cases.model(col, seed)
    return make_model(seed, checkpoint="non_reentrant" if col == "recompute" else None)


@dataclass
class TransformerConfigStandIn:
    """The ``TransformerConfig`` fields the adapter reads, with Megatron-Core's defaults."""

    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    num_moe_experts: int | None = None
    calculate_per_token_loss: bool = False
    init_model_with_meta_device: bool = False


@dataclass
class MCoreDDPConfigStandIn:
    """Megatron-Core's ``DistributedDataParallelConfig``: shared fields and its own."""

    data_parallel_sharding_strategy: str = "no_shard"
    outer_dp_sharding_strategy: str = "no_shard"
    num_distributed_optimizer_instances: int = 1
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = False
    use_megatron_fsdp: bool = False
    grad_reduce_in_fp32: bool = False
    num_buckets: int | None = None
    align_param_gather: bool = False
    megatron_fsdp_use_decoupled_grad: bool = False
    fp8_param_gather: bool = False
    megatron_fsdp_enable_fine_grained_param_gather: bool = False
    bucket_size: int | None = None
    suggested_communication_unit_size: int | None = None
    fsdp_double_buffer: bool = False
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False


def mcore_chunk(module: nn.Module, units: list[type[nn.Module]], **fields: Any) -> Any:
    """``module`` as Megatron-Core wraps a model chunk: ZeRO-3 with the distributed optimizer,
    overlapped reductions and gathers, and ``fields`` of its DDP config."""
    ddp_config = MCoreDDPConfigStandIn(
        data_parallel_sharding_strategy="optim_grads_params",
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        use_distributed_optimizer=True,
        use_megatron_fsdp=True,
        **fields,
    )
    config = TransformerConfigStandIn()
    return FullyShardedDataParallel(config, ddp_config, module, fsdp_unit_modules=units)


def mcore_step(
    chunk: Any,
    optimizer: torch.optim.Optimizer,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """One step as Megatron-Core's loop takes it: buffers zeroed, ``loss(chunk(x), y)``'s
    backward, ``finish_grad_sync``, the step, the main weights copied to the model weights
    and the next gather started."""
    chunk.zero_grad_buffer()
    optimizer.zero_grad()
    loss(chunk(x), y).backward()
    chunk.finish_grad_sync(force_all_reduce=False)
    optimizer.step()
    chunk.param_and_grad_buffer.copy_main_weights_to_model_weights()
    chunk.start_param_sync()


@dataclass
class Built:
    """A wrapped model: what to call, what to step, what checkpoints and gathers take."""

    model: nn.Module  # called for forward; has no_sync(), to(), eval(), train()
    optimizer: torch.optim.Optimizer
    state_model: nn.Module  # for save/load_checkpoint and gather_full_state_dict
    inner: nn.Module  # the user's (now sharded) module


def _seed_kwargs(col: str, layout: Layout) -> dict[str, Any]:
    """The seed entry points' arguments for a column."""
    kwargs: dict[str, Any] = {"zero_dp_strategy": strategy(col)}
    if layout.device_mesh is not None:
        kwargs.update(device_mesh=layout.device_mesh, dp_shard_dim=layout.dp_shard_dim)
    if layout.tp_dim is not None:
        kwargs["tp_dim"] = layout.tp_dim
    if layout.dp_outer_dim is not None:
        kwargs.update(
            dp_outer_dim=layout.dp_outer_dim,
            hybrid_fsdp_group=layout.hybrid_group,
            outer_dp_sharding_strategy="optim" if layout.outer_optim else "no_shard",
        )
    if layout.expert_mesh is not None:
        kwargs["expt_device_mesh"] = layout.expert_mesh
    if col == "meta_init":
        kwargs["init_model_with_meta_device"] = True
    if col == "bf16":
        kwargs["mixed_precision_policy"] = BF16
    if col == "cpu_offload":  # the seed API has no offload argument: refused by name
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if col == "decoupled_grad":
        kwargs["use_decoupled_grad"] = True
    if col == "fine_grained":
        kwargs["enable_fine_grained_param_gather"] = True
    if col == "reshard_int":
        kwargs["reshard_after_forward_group_size"] = 2
    return kwargs


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


@megatron_fsdp.declare_elementwise_optimizer
class DecoupledAdamW(torch.optim.AdamW):
    """AdamW that reads ``decoupled_grad`` and never ``.grad``, as Transformer Engine's
    ``FusedAdam(use_decoupled_grad=True)`` does (and clears it in ``zero_grad``)."""

    use_decoupled_grad = True

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        params = self._params()
        for param in params:
            assert param.grad is None, "use_decoupled_grad: a gradient was put in .grad"
            param.grad = getattr(param, "decoupled_grad", None)
        try:
            return super().step(closure)
        finally:
            for param in params:
                param.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for param in self._params():
            if set_to_none:
                param.decoupled_grad = None  # type: ignore[attr-defined]


def _optimizer(col: str, params: Any) -> torch.optim.Optimizer:
    """The cell's optimizer on the wrapped model's parameters."""
    if col == "decoupled_grad":
        return DecoupledAdamW(params, lr=LR)
    return ecosystem_cases.optimizer(col, params) or _adamw(params)


def _refuses_grad_reader(wrapped: nn.Module) -> None:
    """decoupled_grad: torch's AdamW would read an empty ``.grad`` and silently not step,
    so ``fully_shard_optimizer`` refuses it (checked before the real optimizer is built)."""
    try:
        fully_shard_optimizer(_adamw(wrapped.parameters()))
    except ValueError as error:
        assert "decoupled_grad" in str(error), error
    else:
        raise AssertionError("fully_shard_optimizer took torch's AdamW on decoupled gradients")


def build(row: str, col: str, layout: Layout, seed: int = 0) -> Built:
    """Wrap the column's model through the row's entry point (may raise: a refusal)."""
    module = original_model(col, layout, seed)
    units = [_unit_class(col)]
    torch.manual_seed(seed)  # meta init draws the weights now, as the direct build would
    if row == "seed":
        wrapped, optimizer = megatron_fsdp.fully_shard(
            module,
            _optimizer(col, module.parameters()),
            fsdp_unit_modules=units,
            **_seed_kwargs(col, layout),
        )
        return Built(wrapped, optimizer, wrapped, wrapped.module)
    if row == "model_optimizer":
        wrapped = fully_shard_model(module, fsdp_unit_modules=units, **_seed_kwargs(col, layout))
        if col == "decoupled_grad":
            _refuses_grad_reader(wrapped)
        optimizer = fully_shard_optimizer(_optimizer(col, wrapped.parameters()))
        return Built(wrapped, optimizer, wrapped, wrapped.module)
    if row == "class":
        wrapped = _class_api(module, col, layout, units)
        optimizer = fully_shard_optimizer(_optimizer(col, wrapped.parameters()))
        return Built(wrapped, optimizer, wrapped, wrapped.module)
    if row == "per_module":
        _per_module(module, col, layout, units[0])
        return Built(module, _optimizer(col, module.parameters()), module, module)
    if row == "mcore":
        chunk = _mcore(module, col, layout, units)
        return Built(chunk, _optimizer(col, chunk.parameters()), chunk, chunk.module.module)
    raise ValueError(f"unknown row {row!r}")


def _class_api(
    module: nn.Module, col: str, layout: Layout, units: list[type[nn.Module]]
) -> megatron_fsdp.MegatronFSDP:
    mesh = layout.device_mesh
    if mesh is None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    index = FSDPDistributedIndex(
        mesh,
        dp_shard_dim=layout.dp_shard_dim or "dp_shard",
        dp_outer_dim=layout.dp_outer_dim,
        tp_dim=layout.tp_dim,
        hybrid_fsdp_group=layout.hybrid_group,
        hsdp_outer_dp_shard=layout.outer_optim,
        expt_device_mesh=layout.expert_mesh,
    )
    config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy=_STRATEGY_NAME[strategy(col)],
        outer_dp_sharding_strategy="optim" if layout.outer_optim else "no_shard",
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        megatron_fsdp_use_decoupled_grad=col == "decoupled_grad",
        megatron_fsdp_enable_fine_grained_param_gather=col == "fine_grained",
        reshard_after_forward_group_size=2 if col == "reshard_int" else None,
    )
    kwargs: dict[str, Any] = {"fsdp_unit_modules": units}
    if col == "meta_init":
        kwargs["init_model_with_meta_device"] = True
    if col == "bf16":
        kwargs["mixed_precision_policy"] = BF16
    if col == "cpu_offload":  # no offload keyword in the reference's class: refused by name
        kwargs["offload_policy"] = CPUOffloadPolicy()
    return megatron_fsdp.MegatronFSDP(module, index, config, **kwargs)


def _per_module(module: nn.Module, col: str, layout: Layout, unit: type[nn.Module]) -> None:
    """FSDP2's pattern: each block, then the root, with the same options."""
    options: dict[str, Any] = {"mesh": layout.per_module_mesh, "sharding_strategy": strategy(col)}
    if col == "bf16":
        options["mp_policy"] = BF16
    if col == "decoupled_grad":
        options["mp_policy"] = MixedPrecisionPolicy(use_decoupled_grad=True)
    if col == "cpu_offload":
        options["offload_policy"] = CPUOffloadPolicy()
    if col == "reshard_int":
        options["reshard_after_forward"] = 2
    if family(col) == "float8":
        from mfsdp_te import float8_codecs

        options["param_codecs"] = float8_codecs()
    blocks = [m for m in module.modules() if isinstance(m, unit)]
    if col == "fine_grained":  # FSDP2's way: each leaf of a block is wrapped first
        for block in blocks:
            for leaf in block.modules():
                if (
                    next(leaf.children(), None) is None
                    and next(leaf.parameters(), None) is not None
                ):
                    mfsdp_hooks.fully_shard(leaf, **options)
    for block in blocks:
        mfsdp_hooks.fully_shard(block, experts=layout.experts, **options)
    mfsdp_hooks.fully_shard(module, **options)


def _torch_sd_model(built: Built) -> nn.Module:
    """What torch's state-dict helpers take: a Megatron-Core chunk's ``module`` (the chunk's
    own state_dict() keys are one level short of its parameter paths; see ``mcore``)."""
    model = built.state_model
    return model.module if isinstance(model, MCoreFSDPModel) else model


def _mcore(module: nn.Module, col: str, layout: Layout, units: list[type[nn.Module]]) -> Any:
    config = TransformerConfigStandIn(
        tensor_model_parallel_size=2 if family(col) == "tp" else 1,
        context_parallel_size=2 if col == "cp" else 1,
        expert_model_parallel_size=2 if col == "ep" else 1,
        num_moe_experts=NUM_EXPERTS if col == "ep" else None,
        init_model_with_meta_device=col == "meta_init",
    )
    ddp_config = MCoreDDPConfigStandIn(
        data_parallel_sharding_strategy=_STRATEGY_NAME[strategy(col)],
        # Megatron-Core's HSDP: several distributed-optimizer instances (HFSDP: and the
        # optimizer sharded across them).
        num_distributed_optimizer_instances=2 if col in ("hsdp", "hfsdp", "hfsdp_tp") else 1,
        outer_dp_sharding_strategy="optim" if col in ("hfsdp", "hfsdp_tp") else "no_shard",
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        use_distributed_optimizer=True,
        use_megatron_fsdp=True,
        grad_reduce_in_fp32=col == "bf16",
        megatron_fsdp_use_decoupled_grad=col == "decoupled_grad",
        megatron_fsdp_enable_fine_grained_param_gather=col == "fine_grained",
    )
    if col == "reshard_int":  # not in Megatron-Core's config: megatron_fsdp's config carries it
        ours = DistributedDataParallelConfig.from_any(ddp_config)
        ddp_config = dataclasses.replace(ours, reshard_after_forward_group_size=2)
    if col == "bf16":  # Megatron-Core's Float16Module: the model itself in bf16
        module = module.bfloat16()
    extra: dict[str, Any] = {}
    if col == "cpu_offload":
        extra["offload_policy"] = CPUOffloadPolicy()
    if layout.tp_mesh is not None:  # Megatron-Core's groups, as its ProcessGroupCollection
        assert layout.device_mesh is not None
        extra["pg_collection"] = SimpleNamespace(
            dp_cp=layout.device_mesh["dp_shard"].get_group(),
            tp=layout.tp_mesh.get_group(),
            tp_dp_cp=dist.group.WORLD,
        )
        if layout.hybrid_group is not None:  # HSDP: the whole DP group and its two parts
            extra["pg_collection"].dp_cp = layout.hybrid_group
            extra["pg_collection"].intra_dp_cp = layout.device_mesh["dp_shard"].get_group()
            extra["pg_collection"].inter_dist_opt = layout.device_mesh["dp_outer"].get_group()
    if layout.expert_mesh is not None:  # the dense DP group and the expert-data-parallel one
        assert layout.device_mesh is not None
        extra["pg_collection"] = SimpleNamespace(
            dp_cp=layout.device_mesh["dp_shard"].get_group(),
            expt_dp=layout.expert_mesh["dp_shard"].get_group(),
        )
    return FullyShardedDataParallel(config, ddp_config, module, fsdp_unit_modules=units, **extra)


# --------------------------------------------------------------------------- training
def train_step(built: Built, row: str, col: str, step: int, layout: Layout) -> float:
    """One optimizer step on ``step``'s batch; returns the global loss (mean over ranks)."""
    model, optimizer = built.model, built.optimizer
    micro = micro_batches(col)
    x, y = global_batch(col, step)
    if row == "mcore":  # Megatron-Core's order: buffers zeroed before the forward passes
        model.zero_grad_buffer()  # type: ignore[operator]
        optimizer.zero_grad()
    total = torch.zeros(())
    pairs = list(zip(x.chunk(micro), y.chunk(micro), strict=True))
    for index, (mx, my) in enumerate(pairs):
        lx, ly = local_share(mx, my, layout)
        last = index == micro - 1
        with contextlib.nullcontext() if last else model.no_sync():  # type: ignore[operator]
            loss = batch_loss(col, model(lx), ly)
            # Megatron-Core sums the micro-batches' gradients and scale_gradients averages.
            (loss if row == "mcore" else loss / micro).backward()
        total += loss.detach().float() / micro
    if row == "mcore":
        model.finish_grad_sync(force_all_reduce=False)  # type: ignore[operator]
        if micro > 1:
            model.scale_gradients(1 / micro)  # type: ignore[operator]
        _check_decoupled(built, col)
        optimizer.step()
        model.param_and_grad_buffer.copy_main_weights_to_model_weights()  # type: ignore[union-attr]
        model.start_param_sync()  # type: ignore[operator]
    else:
        _check_decoupled(built, col)
        optimizer.step()
        optimizer.zero_grad()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def eval_loss(built: Built, col: str, layout: Layout) -> float:
    """train_eval: ``eval()``, a ``no_grad`` forward on the eval batch, ``train()``."""
    built.model.eval()
    with torch.no_grad():
        lx, ly = local_share(*eval_batch(), layout)
        total = batch_loss(col, built.model(lx), ly).detach().float()
    built.model.train()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _check_decoupled(built: Built, col: str) -> None:
    """decoupled_grad: after a backward, every trainable parameter's reduced gradient is in
    ``decoupled_grad`` and ``.grad`` is None (the engine put nothing there)."""
    if col != "decoupled_grad":
        return
    for name, param in built.model.named_parameters():
        if param.requires_grad:
            assert param.grad is None, f"{name}: .grad was set"
            held = getattr(param, "decoupled_grad", None)
            assert held is not None and held.shape == param.shape, name


def _check_post_forward_groups(built: Built, col: str) -> None:
    """reshard_int: the option reached every unit, as pairs of consecutive ranks."""
    if col != "reshard_int":
        return
    units = mfsdp_hooks.fsdp_units(built.inner)
    assert units and all(u.options.post_forward is not None for u in units), "not honoured"
    assert {u.options.post_forward.size for u in units if u.options.post_forward} == {2}


def _install_comm_hooks(built: Built) -> list[tuple[Any, ...]]:
    """comm_hooks: FSDP2's custom all-gather and reduce-scatter (exact, counted) and an
    all-reduce hook on every unit the entry point made; per unit, its comms and how many
    gradient reductions a step makes."""
    installed = []
    for module in built.model.modules():
        if not isinstance(module, mfsdp_hooks.FSDPModule):
            continue
        gather, scatter, hook = CountingAllGather(), CountingReduceScatter(), GradientRecorder()
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(scatter)
        module.set_all_reduce_hook(hook)
        unit = mfsdp_hooks.fsdp_units(module)[0]  # its own unit comes first
        installed.append((gather, scatter, hook, sum(g.reducer is not None for g in unit.groups)))
    return installed


def _check_comm_hooks(installed: list[tuple[Any, ...]]) -> None:
    """Every unit gathered through its comm and reduced through its comm once per step,
    the hook seeing each reduction."""
    if not installed:
        return
    for gather, scatter, hook, reductions in installed:
        assert gather.calls > 0 and len(gather.allocated) == gather.calls, "gathers bypassed"
        assert scatter.calls == len(hook.sums) == STEPS * reductions, "reductions bypassed"


def _check_tied_and_frozen(built: Built, col: str, trained: bool) -> None:
    inner = built.inner
    if col == "tied":
        assert inner.head.weight is inner.embed.weight, "the tie was lost by wrapping"
        names = [n for n, _ in built.model.named_parameters()]
        assert not any(n.endswith("head.weight") for n in names), names  # one parameter
    if col == "frozen":
        weight = inner.frozen.weight
        assert not weight.requires_grad, "the frozen layer became trainable"
        if trained:
            assert weight.grad is None, "the frozen layer got a gradient"


def final_weights(built: Built, col: str, layout: Layout) -> dict[str, torch.Tensor]:
    """Every parameter's full value, named as in the one-process model (collective)."""
    kind = family(col)
    if kind in ("toy", "tp"):
        full = gather_full_state_dict(built.state_model, rank0_only=False)
        return {_plain(k): v.float() for k, v in full.items()}
    weights = {}
    for name, param in built.model.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        parts = _plain(name).split(".")
        if kind == "ep" and "experts" in parts:  # local expert K is global first + K
            assert layout.expert_mesh is not None
            per_rank = NUM_EXPERTS // layout.expert_mesh["ep"].size()
            first = layout.expert_mesh["ep"].get_local_rank() * per_rank
            at = parts.index("experts") + 1
            parts[at] = str(first + int(parts[at]))
        weights[".".join(parts)] = value.detach().float().clone()
    return weights


def _plain(name: str) -> str:
    while name.startswith("module."):
        name = name.removeprefix("module.")
    return name


def cell_worker(rank: int, world: int, row: str, col: str, ckpt: str) -> dict[str, Any]:
    """One cell on one rank: the refusal, or losses, eval losses and final weights."""
    layout = make_layout(col, rank, world)
    try:
        built = build(row, col, layout)
    except Exception as error:  # a refusal: every rank must raise it, before communicating
        dist.barrier()
        return {"refused": (type(error), str(error))}
    if col == "to_device":  # transformers.Trainer's call, and a dtype no-op
        built.model.to(torch.device("cpu", 0))
        built.model.float()
    comms = _install_comm_hooks(built) if col == "comm_hooks" else []
    called, compiler = ecosystem_cases.compiled(col, built.model, _unit_class(col))
    built = dataclasses.replace(built, model=called)
    _check_tied_and_frozen(built, col, trained=False)
    losses, evals = [], []
    for step in range(STEPS):
        if col == "dcp_resume" and step == SAVE_AFTER:
            save_checkpoint(ckpt, built.state_model, built.optimizer)
            built = build(row, col, layout, seed=123)  # another init: the load must win
            load_checkpoint(ckpt, built.state_model, built.optimizer)
        if col in ecosystem_cases.ROUND_TRIPS and step == SAVE_AFTER:
            load = ecosystem_cases.round_trip(col, _torch_sd_model(built), built.optimizer, ckpt)
            built = build(row, col, layout, seed=123)
            load(_torch_sd_model(built), built.optimizer)
        try:
            losses.append(train_step(built, row, col, step, layout))
        except Exception as error:  # an optimizer built after wrapping is refused here
            if step > 0 or col not in ecosystem_cases.REFUSED_AT_FIRST_FORWARD:
                raise
            dist.barrier()
            return {"refused": (type(error), str(error))}
        if col == "train_eval":
            evals.append(eval_loss(built, col, layout))
    assert compiler is None or compiler.graphs > 0, f"{col}: torch.compile compiled nothing"
    _check_tied_and_frozen(built, col, trained=True)
    _check_post_forward_groups(built, col)
    _check_comm_hooks(comms)
    # Plain lists: tensors sent back from a rank would travel as shared-memory handles that
    # die with the rank.
    weights = {k: v.tolist() for k, v in final_weights(built, col, layout).items()}
    return {"losses": losses, "evals": evals, "weights": weights}


# --------------------------------------------------------------------------- reference
@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """The ranks run single-threaded; so does the reference (bf16 sums are order-sensitive)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _reference_model(row: str, col: str) -> nn.Module:
    kind = family(col)
    if kind == "tp":
        return tp_model("mlp", None)
    if kind == "ep":
        return moe_model(None)
    if kind == "float8":
        from mfsdp_te.float8_testing import float8_model

        return float8_model()
    if col in ecosystem_cases.MODEL_COLS:
        return ecosystem_cases.model(col, 0)
    model = make_model(0, checkpoint="non_reentrant" if col == "recompute" else None)
    if col == "meta_init" and row == "per_module":
        _per_module_init_order(model)
    if col == "bf16" and row == "mcore":  # the bf16 model's weights are the main weights'
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.bfloat16().float())
    return model


def _per_module_init_order(model: nn.Module) -> None:
    """Per-module meta init initialises in the order the wraps ran: each block's modules,
    then the root's own (embed, frozen, head on a scratch copy as its weight is tied,
    value): the reference draws its weights in that order too."""
    torch.manual_seed(0)
    for block in model.blocks:  # type: ignore[union-attr]
        for module in block.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    model.embed.reset_parameters()  # type: ignore[operator]
    model.frozen.reset_parameters()  # type: ignore[operator]
    nn.Linear(model.head.in_features, model.head.out_features, bias=False)  # type: ignore[arg-type]
    model.value.reset_parameters()  # type: ignore[operator]


def reference_run(row: str, col: str) -> dict[str, Any]:
    """The cell's one-process training: losses, eval losses, final weights."""
    with _one_thread():
        master = _reference_model(row, col)
        # bf16: fp32 main weights step; each share runs forward and backward on a bf16
        # copy, its gradient taken to fp32 before the mean over shares (reduce_dtype).
        compute = copy.deepcopy(master).bfloat16() if col == "bf16" else master
        optimizer = ecosystem_cases.optimizer(col, master.parameters()) or _adamw(
            master.parameters()
        )
        micro, shares = micro_batches(col), shares_in_reference(col)
        losses, evals = [], []
        for step in range(STEPS):
            x, y = global_batch(col, step)
            total = 0.0
            for mx, my in zip(x.chunk(micro), y.chunk(micro), strict=True):
                for sx, sy in zip(mx.chunk(shares), my.chunk(shares), strict=True):
                    loss = batch_loss(col, compute(sx), sy)
                    (loss / (micro * shares)).backward()
                    total += loss.item() / (micro * shares)
                    if compute is not master:
                        _bf16_grads_to_master(compute, master)
            optimizer.step()
            optimizer.zero_grad()
            if compute is not master:
                _master_to_compute(master, compute)
            losses.append(total)
            if col == "train_eval":
                with torch.no_grad():
                    evals.append(batch_loss(col, master(eval_batch()[0]), eval_batch()[1]).item())
        weights = {k: v.detach().float().clone() for k, v in _reference_state(master, col).items()}
    return {"losses": losses, "evals": evals, "weights": weights}


def _bf16_grads_to_master(compute: nn.Module, master: nn.Module) -> None:
    for low, high in zip(compute.parameters(), master.parameters(), strict=True):
        if low.grad is not None:
            grad = low.grad.float()
            high.grad = grad if high.grad is None else high.grad + grad
            low.grad = None


def _master_to_compute(master: nn.Module, compute: nn.Module) -> None:
    with torch.no_grad():
        for high, low in zip(master.parameters(), compute.parameters(), strict=True):
            low.copy_(high)


def _reference_state(model: nn.Module, col: str) -> dict[str, torch.Tensor]:
    if family(col) in ("toy", "tp"):
        return dict(model.state_dict())
    return dict(model.named_parameters())


def assert_parity(
    got: dict[str, Any], want: dict[str, Any], col: str, rtol: float, what: str
) -> None:
    """Losses, eval losses and final weights within ``rtol`` relative (``assert_close_rel``:
    the largest error over the largest expected magnitude)."""
    from mfsdp_hooks.testing import assert_close_rel

    for name in ("losses", "evals"):
        assert len(got[name]) == len(want[name]), (what, name, got[name], want[name])
        for step, (a, b) in enumerate(zip(got[name], want[name], strict=True)):
            assert abs(a - b) <= rtol * abs(b), f"{what}: {name}[{step}] {a} != {b}: {got[name]}"
    weights = {k: torch.tensor(v) for k, v in got["weights"].items()}
    expected: dict[str, torch.Tensor] = want["weights"]
    if family(col) == "ep":  # each rank holds its own experts: compare those
        expected = {k: v for k, v in expected.items() if k in weights}
    assert weights.keys() == expected.keys(), (what, sorted(weights), sorted(expected))
    for name, value in expected.items():
        assert_close_rel(weights[name], value, rtol, f"{what}: {name}")
