"""The three things a rank can train, behind one small interface.

* ``ours``: ``mfsdp_hooks.fully_shard`` on each block, then on the root;
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` with the same call pattern;
* ``local``: no sharding and no communication: the per-rank computation FSDP cannot avoid
  (forward and backward of the whole model on the per-rank batch, AdamW on a 1/world share of
  the elements, fp32 master weights in bf16 mode). Its step time is the denominator of the
  overlap efficiency, so everything FSDP adds on top, exposed communication, copies and
  framework overhead, shows up in that ratio.

All three use ``torch.optim.AdamW`` with the same hyper-parameters over the parameters the
model exposes, and the same fp32 loss. Ours passes it through ``attach_optimizer`` (what the
seed's ``fully_shard_optimizer`` does), which steps contiguous runs of the sharded buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from benchmarks.configs import RunSpec
from benchmarks.model import GPT, loss_fn
from mfsdp_collectives import FSDPTopology

LR = 1e-3
WEIGHT_DECAY = 0.01


class Trainer:
    """One training step split into the phases the benchmark times and measures."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        after_step: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self._after_step = after_step

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(self.model(x), y)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()  # type: ignore[no-untyped-call]

    def step(self) -> None:
        self.optimizer.step()
        if self._after_step is not None:
            self._after_step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def _float8(model: GPT, spec: RunSpec) -> None:
    """With ``spec.float8``: torchao float8 training of every block's Linear layers, their
    weights all-gathered as float8 (``enable_fsdp_float8_all_gather``)."""
    if not spec.float8:
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(
        model, config=config, module_filter_fn=lambda _, fqn: fqn.startswith("blocks.")
    )


def _tensor_parallel(model: GPT, spec: RunSpec) -> DeviceMesh | None:
    """With ``spec.tp > 1``: cut every block's MLP over TP (fc1 colwise, fc2 rowwise) and
    return the DP mesh FSDP shards over; None otherwise."""
    if spec.tp == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    shape = (spec.world_size // spec.tp, spec.tp)
    mesh = init_device_mesh(spec.device_type, shape, mesh_dim_names=("dp_shard", "tp"))
    for block in model.blocks:
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        parallelize_module(block, mesh["tp"], plan)
    return mesh["dp_shard"]


def _hsdp_mesh(spec: RunSpec) -> DeviceMesh | None:
    """The (dp_outer, dp_shard) mesh of an HSDP run, or None for plain FSDP."""
    if spec.hsdp_outer == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    shape = (spec.hsdp_outer, spec.world_size // spec.hsdp_outer)
    return init_device_mesh(spec.device_type, shape, mesh_dim_names=("dp_outer", "dp_shard"))


def _topology_of(mesh: DeviceMesh | None, spec: RunSpec) -> FSDPTopology | None:
    """HFSDP's topology (the optimizer cut across dp_outer), or None to pass ``mesh``."""
    if mesh is None or not spec.outer_optim:
        return None
    import torch.distributed as dist

    topology = FSDPTopology.from_mesh(mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
    group = dist.group.WORLD  # the flattened (dp_outer, dp_shard) mesh spans every rank
    assert group is not None
    topology.shard_optimizer_across_outer(group)
    return topology


def _adamw(params: list[torch.Tensor] | list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def _block_reshard(spec: RunSpec) -> bool | int:
    """The blocks' ``reshard_after_forward``: True, or the smaller group's size."""
    return spec.reshard_after_forward if spec.reshard_after_forward > 1 else True


def build_ours(model: GPT, spec: RunSpec) -> Trainer:
    import mfsdp_hooks
    import mfsdp_te

    policy = (
        mfsdp_hooks.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        if spec.precision == "bf16"
        else None
    )
    # One allocator for the whole model, so a pool is shared by its units.
    allocator = mfsdp_hooks.make_grad_allocator(spec.grad_allocator, max_inflight_reductions=1)
    mesh = _tensor_parallel(model, spec) or _hsdp_mesh(spec)
    topology = _topology_of(mesh, spec)
    _float8(model, spec)
    codecs = mfsdp_te.float8_codecs()
    block_numel = sum(p.numel() for p in model.blocks[0].parameters())
    for module in [*model.blocks, model]:
        mfsdp_hooks.fully_shard(
            module,
            reshard_after_forward=_block_reshard(spec) if module is not model else None,
            mesh=topology or mesh,
            sharding_strategy=3,
            mp_policy=policy,
            grad_buffer_allocator=allocator,
            host_transport=spec.host_transport,
            backward_prefetch_grad_fraction=spec.backward_prefetch_grad_fraction,
            prefetch_depth=spec.prefetch_depth,
            param_codecs=codecs,
            prefetch_numel=spec.merge_blocks * block_numel if spec.merge_blocks else None,
            coalesce_prefetch=spec.merge_blocks > 0,
        )
    if spec.quantize_comms != "none":
        from mfsdp_collectives import BlockQuantization

        weights = BlockQuantization() if spec.quantize_comms == "grads+weights" else None
        mfsdp_hooks.quantize_communication(model, weights=weights)
    if spec.serial_reductions:
        for unit in mfsdp_hooks.fsdp_units(model):
            transport = unit.options.topology.host_transport
            if transport is not None:
                transport.concurrent_reductions = False
    # The seed's optimizer integration: the same torch AdamW, stepped over contiguous runs of
    # the sharded buffers unless the run measures torch's per-parameter loop.
    optimizer = mfsdp_hooks.attach_optimizer(
        _adamw(list(model.parameters())), contiguous_step=spec.contiguous_step
    )
    return Trainer(model, optimizer)


def build_fsdp2(model: GPT, spec: RunSpec, device: torch.device) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = (
        _tensor_parallel(model, spec)
        or _hsdp_mesh(spec)
        or init_device_mesh(device.type, (spec.world_size,))
    )
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        if spec.precision == "bf16"
        else MixedPrecisionPolicy()
    )
    _float8(model, spec)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=_block_reshard(spec))
    # reshard_after_forward left at its default: True for blocks, False for the root (whose
    # parameters backward needs at once), which is what our engine does too.
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return Trainer(model, _adamw(list(model.parameters())), _float8_scales(model, spec))


def _float8_scales(model: nn.Module, spec: RunSpec) -> Callable[[], None] | None:
    """FSDP2 with float8: torchao's recommended one all-reduce for every scale per step."""
    if not spec.float8:
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return lambda: precompute_float8_dynamic_scale_for_fsdp(model)


def _share(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous 1/world of a flat tensor (possibly shorter on the last rank)."""
    chunk = -(-flat.numel() // world)
    return flat[rank * chunk : (rank + 1) * chunk]


class LocalTrainer(Trainer):
    """Unsharded model; AdamW on this rank's 1/world share of every parameter's elements.

    fp32: AdamW steps in place on views of the parameters, as FSDP2 steps on its shards.
    bf16: the model computes in bf16; AdamW steps on fp32 master shares that are cast back
    into the bf16 weights after the step, as both FSDPs do with their main weights.
    """

    def __init__(self, model: GPT, spec: RunSpec, rank: int) -> None:
        self.rank, self.world = rank, spec.world_size
        self.bf16 = spec.precision == "bf16"
        self.params = list(model.parameters())
        with torch.no_grad():
            masters = [
                self._share(p).float().clone() if self.bf16 else self._share(p) for p in self.params
            ]
            if self.bf16:
                model.to(torch.bfloat16)  # swaps .data: the Parameter objects stay
        self.masters = masters
        super().__init__(model, _adamw(masters))

    def _share(self, t: torch.Tensor) -> torch.Tensor:
        return _share(t.detach().view(-1), self.rank, self.world)

    def step(self) -> None:
        for param, master in zip(self.params, self.masters, strict=True):
            grad = param.grad
            if grad is None:
                master.grad = None
            else:
                piece = _share(grad.view(-1), self.rank, self.world)
                master.grad = piece.float() if self.bf16 else piece
        self.optimizer.step()
        if self.bf16:
            with torch.no_grad():
                for param, master in zip(self.params, self.masters, strict=True):
                    self._share(param).copy_(master)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)


def build(spec: RunSpec, rank: int, device: torch.device) -> Trainer:
    """The model (same seed on every rank and implementation) wrapped as ``spec.impl`` says."""
    torch.manual_seed(spec.seed)
    model = GPT(spec.model).to(device)
    if spec.impl == "ours":
        return build_ours(model, spec)
    if spec.impl == "fsdp2":
        return build_fsdp2(model, spec, device)
    return LocalTrainer(model, spec, rank)


__all__ = ["LocalTrainer", "Trainer", "build"]
