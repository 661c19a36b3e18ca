"""A matrix cell's model wrapped through each row's entry point (``build``), with the
column's options and optimizer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import ecosystem_cases
import torch
import torch.distributed as dist
from matrix_columns import BF16, LR, STRATEGY_NAME, family, strategy, unit_class
from matrix_layouts import Layout
from mcore_stand_ins import MCoreDDPConfigStandIn, TransformerConfigStandIn
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
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
from mfsdp_hooks.testing import ToyModel, make_model
from mfsdp_hooks.testing.moe import NUM_EXPERTS, moe_model
from mfsdp_hooks.testing.tp import megatron_tp_model, tp_model


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


def adamw(params: Any) -> torch.optim.Optimizer:
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
    return ecosystem_cases.optimizer(col, params) or adamw(params)


def _refuses_grad_reader(wrapped: nn.Module) -> None:
    """decoupled_grad: torch's AdamW would read an empty ``.grad`` and silently not step,
    so ``fully_shard_optimizer`` refuses it (checked before the real optimizer is built)."""
    try:
        fully_shard_optimizer(adamw(wrapped.parameters()))
    except ValueError as error:
        assert "decoupled_grad" in str(error), error
    else:
        raise AssertionError("fully_shard_optimizer took torch's AdamW on decoupled gradients")


def build(row: str, col: str, layout: Layout, seed: int = 0) -> Built:
    """Wrap the column's model through the row's entry point (may raise: a refusal)."""
    module = original_model(col, layout, seed)
    units = [unit_class(col)]
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
        if col == "meta_init":  # FSDP2's contract: storage, then the user's weights
            module.to_empty(device="cpu")
            direct = make_model(seed).state_dict()
            set_model_state_dict(module, direct, options=StateDictOptions(full_state_dict=True))
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
        data_parallel_sharding_strategy=STRATEGY_NAME[strategy(col)],
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


def torch_sd_model(built: Built) -> nn.Module:
    """What torch's state-dict helpers take: a Megatron-Core chunk's ``module`` (the chunk's
    own state_dict() keys are one level short of its parameter paths; see ``mcore``)."""
    model = built.state_model
    return model.module if isinstance(model, MCoreFSDPModel) else model


def _mcore(module: nn.Module, col: str, layout: Layout, units: list[type[nn.Module]]) -> Any:
    config = TransformerConfigStandIn(
        tensor_model_parallel_size=2 if family(col) == "tp" else 1,
        context_parallel_size=2 if col == "cp" else 1,
        expert_model_parallel_size=2 if family(col) == "ep" else 1,
        num_moe_experts=NUM_EXPERTS if family(col) == "ep" else None,
        init_model_with_meta_device=col == "meta_init",
    )
    ddp_config = MCoreDDPConfigStandIn(
        data_parallel_sharding_strategy=STRATEGY_NAME[strategy(col)],
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
