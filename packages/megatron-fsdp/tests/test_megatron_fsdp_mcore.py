"""``megatron_fsdp.mcore.FullyShardedDataParallel`` driven as Megatron-Core's training loop
drives a model chunk, without a megatron-core dependency.

The configs from ``mcore_stand_ins`` stand in for Megatron-Core's ``TransformerConfig`` and
``DistributedDataParallelConfig`` (dataclasses with their field names and defaults, including
fields ours does not have); the loop follows ``megatron/training/training.py`` and
``finalize_model_grads``: ``zero_grad_buffer``, micro-batches under ``no_sync`` with the last
one outside, ``finish_grad_sync``, ``scale_gradients``, a plain optimizer over the sharded
parameters, ``copy_main_weights_to_model_weights`` and ``start_param_sync``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from mcore_stand_ins import MCoreDDPConfigStandIn, TransformerConfigStandIn
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp import DistributedDataParallelConfig, FSDPDistributedIndex, MegatronFSDP
from megatron_fsdp.mcore import FullyShardedDataParallel
from megatron_fsdp.mcore_grad_norm import clip_grad_norm
from mfsdp_checkpoint import gather_full_state_dict
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import fsdp_units
from mfsdp_hooks.testing import (
    Block,
    assert_close_rel,
    local_slice,
    loss_fn,
    make_batches,
    make_model,
)
from mfsdp_hooks.testing.offload import forced_host_copies, offloads

STEPS = 10
MICRO_BATCHES = 3


def _mcore_loop_worker(rank: int, world: int, strategy: str) -> list[float]:
    offload = strategy.endswith("+offload")  # ours: Megatron-Core keeps it on OptimizerConfig
    fields = dict(
        data_parallel_sharding_strategy=strategy.removesuffix("+offload"),
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        use_distributed_optimizer=True,
    )
    ddp_config: Any = (
        DistributedDataParallelConfig(**fields, optimizer_cpu_offload=True)
        if offload
        else MCoreDDPConfigStandIn(**fields, use_megatron_fsdp=True)
    )
    with forced_host_copies() if offload else contextlib.nullcontext():
        model = FullyShardedDataParallel(
            TransformerConfigStandIn(), ddp_config, make_model(), fsdp_unit_modules=[Block]
        )
    assert isinstance(model.module, MegatronFSDP)
    assert len(offloads(model.module)) == (len(fsdp_units(model.module)) if offload else 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for tokens, targets in make_batches(STEPS, global_batch=12):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        micro = list(zip(tokens.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES), strict=True))
        total = torch.zeros(())
        for index, (x, y) in enumerate(micro):
            last = index == len(micro) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
                loss.backward()  # summed over micro-batches; scale_gradients averages
            total += loss.detach()
        model.finish_grad_sync(force_all_reduce=False)
        model.scale_gradients(1 / MICRO_BATCHES)  # SGD: a wrong scale changes the curve
        optimizer.step()
        model.param_and_grad_buffer.copy_main_weights_to_model_weights()
        model.start_param_sync()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world / MICRO_BATCHES)
    return losses


def _single_process() -> list[float]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for tokens, targets in make_batches(STEPS, global_batch=12):
        micro = zip(tokens.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES), strict=True)
        step_losses = [loss_fn(model(x), y) / MICRO_BATCHES for x, y in micro]
        sum(step_losses).backward()  # type: ignore[union-attr]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(loss.item() for loss in step_losses))
    return losses


@pytest.mark.parametrize(
    "strategy", ["optim_grads_params", "optim", "no_shard", "optim_grads_params+offload"]
)
def test_a_megatron_core_loop_trains_as_one_process(strategy: str) -> None:
    """``+offload``: host offload through our config (``optimizer_cpu_offload``), on CPU
    with the copies forced, the main weights, gradients and SGD's state on the host; each
    micro-batch under ``no_sync`` reduce-scatters into them (Megatron-FSDP's default)."""
    want = _single_process()
    for got in run_distributed(_mcore_loop_worker, 2, strategy, timeout=180):
        for a, b in zip(got, want, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (got, want)


def _state_dict_worker(rank: int, world: int) -> dict[str, Any]:
    del rank, world
    config = MCoreDDPConfigStandIn(data_parallel_sharding_strategy="optim_grads_params")
    model = FullyShardedDataParallel(
        TransformerConfigStandIn(), make_model(), config, fsdp_unit_modules=[Block]
    )  # the seeds' guide's order: module before ddp_config
    saved = model.state_dict_for_save_checkpoint()
    keys = sorted(saved)
    plain = {k.removeprefix("module."): v.full_tensor() for k, v in saved.items()}
    other = FullyShardedDataParallel(
        TransformerConfigStandIn(), config, make_model(seed=5), fsdp_unit_modules=[Block]
    )
    other.load_state_dict(model.state_dict())  # keys with the prefix
    same_prefixed = all(
        torch.equal(v.full_tensor(), plain[k.removeprefix("module.")])
        for k, v in other.state_dict().items()
    )
    third = FullyShardedDataParallel(
        TransformerConfigStandIn(), config, make_model(seed=6), fsdp_unit_modules=[Block]
    )
    third.load_state_dict(
        {k.removeprefix("module."): v for k, v in model.state_dict().items()}
    )  # without: Megatron-Core adds it
    same_plain = all(
        torch.equal(v.full_tensor(), plain[k.removeprefix("module.")])
        for k, v in third.state_dict().items()
    )
    try:  # what torch's broadcast load leaves a receiving rank when given the chunk
        third.load_state_dict({})
        empty = "accepted"
    except RuntimeError as error:
        empty = str(error)
    return {"keys": keys, "same_prefixed": same_prefixed, "same_plain": same_plain, "empty": empty}


def test_state_dict_keys_and_loading_with_or_without_the_module_prefix() -> None:
    for result in run_distributed(_state_dict_worker, 2, timeout=120):
        assert all(k.startswith("module.") for k in result["keys"]), result["keys"]
        assert result["same_prefixed"] and result["same_plain"]
        assert "pass chunk.module" in result["empty"], result["empty"]


def _refusal_worker(rank: int, world: int, case: str) -> str:
    del rank
    config: Any = TransformerConfigStandIn()
    ddp_config: Any = MCoreDDPConfigStandIn(data_parallel_sharding_strategy="optim_grads_params")
    units: Any = [Block]
    model = make_model()
    extra: dict[str, Any] = {}
    if case == "class_instances_without_outer":  # the reference's class, a 1-D dist index
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        ddp_config = MCoreDDPConfigStandIn(num_distributed_optimizer_instances=2)
        try:
            MegatronFSDP(model, FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard"), ddp_config)
        except ValueError as error:
            return f"{type(error).__name__}: {error}"
        return "accepted"
    if case == "pipeline_without_groups":
        config = TransformerConfigStandIn(pipeline_model_parallel_size=2)
    elif case == "tied_across_stages":
        config = TransformerConfigStandIn(pipeline_model_parallel_size=2)
        model.share_embeddings_and_output_weights = True  # as GPTModel has it
    elif case == "instances_not_dividing":
        ddp_config.num_distributed_optimizer_instances = 3
    elif case == "tensor_parallel":
        config = TransformerConfigStandIn(tensor_model_parallel_size=2)
    elif case == "tp_group_disagrees":
        group = torch.distributed.group.WORLD
        extra = {"pg_collection": SimpleNamespace(dp_cp=group, tp=group, tp_dp_cp=group)}
    elif case == "experts_without_groups":
        config = TransformerConfigStandIn(num_moe_experts=4, expert_model_parallel_size=2)
    elif case == "tensor_parallel_experts":
        config = TransformerConfigStandIn(num_moe_experts=4, expert_tensor_parallel_size=2)
    elif case == "mcore_only_field":
        ddp_config = MCoreDDPConfigStandIn(megatron_fsdp_version=2)
    elif case == "no_units_without_mcore":
        units = None
    try:
        FullyShardedDataParallel(config, ddp_config, model, fsdp_unit_modules=units, **extra)
    except (NotImplementedError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (
            "tensor_parallel",
            "ValueError: config.tensor_model_parallel_size=2: the data-parallel group is not",
        ),
        (
            "tp_group_disagrees",
            "ValueError: config.tensor_model_parallel_size=1 but the tensor-parallel group has "
            "2 rank(s)",
        ),
        (
            "experts_without_groups",
            "ValueError: config.num_moe_experts with expert_model_parallel_size=2: pass "
            "pg_collection with 'expt_dp'",
        ),
        (
            "tensor_parallel_experts",
            "NotImplementedError: config.expert_tensor_parallel_size=2",
        ),
        ("mcore_only_field", "NotImplementedError: ddp_config.megatron_fsdp_version=2"),
        pytest.param(
            "no_units_without_mcore",
            "ValueError: fsdp_unit_modules is required",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("megatron") is not None,
                reason="megatron-core is installed: its layer classes are the default units",
            ),
        ),
        (
            "pipeline_without_groups",
            "ValueError: config.pipeline_model_parallel_size=2: the data-parallel group is not",
        ),
        (
            "tied_across_stages",
            "NotImplementedError: config.pipeline_model_parallel_size=2 with "
            "share_embeddings_and_output_weights=True",
        ),
        (
            "instances_not_dividing",
            "ValueError: ddp_config.num_distributed_optimizer_instances=3 does not divide",
        ),
        (
            "class_instances_without_outer",
            "ValueError: ddp_config.num_distributed_optimizer_instances=2 asks for HSDP",
        ),
    ],
)
def test_what_the_adapter_cannot_do_is_refused_at_wrap_time(case: str, expected: str) -> None:
    for message in run_distributed(_refusal_worker, 2, case, timeout=60):
        assert message.startswith(expected), message


def _clip_worker(rank: int, world: int, strategy: str, norm_type: float) -> list[float]:
    """One step's gradients through the adapter, clipped (a max norm well below theirs),
    then applied with SGD: the norm and the updated full weights."""
    ddp_config = MCoreDDPConfigStandIn(data_parallel_sharding_strategy=strategy)
    model = FullyShardedDataParallel(
        TransformerConfigStandIn(), ddp_config, make_model(), fsdp_unit_modules=[Block]
    )
    tokens, targets = make_batches(1, global_batch=8)[0]
    loss_fn(model(local_slice(tokens, rank, world)), local_slice(targets, rank, world)).backward()
    model.finish_grad_sync()
    norm = clip_grad_norm(model, 1e-3, norm_type)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    model.param_and_grad_buffer.copy_main_weights_to_model_weights()
    full = gather_full_state_dict(model.module, rank0_only=False)
    return [norm.item(), *torch.cat([v.reshape(-1) for v in full.values()]).tolist()]


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim", "no_shard"])
def test_clip_grad_norm_over_sharded_chunks_as_one_process(strategy: str, norm_type: float) -> None:
    model = make_model()
    tokens, targets = make_batches(1, global_batch=8)[0]
    loss_fn(model(tokens), targets).backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    want_norm = torch.nn.utils.clip_grad_norm_(trainable, 1e-3, norm_type).item()
    torch.optim.SGD(trainable, lr=1.0).step()
    want = torch.cat([v.reshape(-1) for v in model.state_dict().values()])
    for got in run_distributed(_clip_worker, 2, strategy, norm_type, timeout=120):
        assert abs(got[0] - want_norm) <= 1e-5 * want_norm, (got[0], want_norm)
        assert_close_rel(torch.tensor(got[1:]), want, 1e-5, f"{strategy} clipped step")


def _clip_refusal_worker(rank: int, world: int) -> str:
    try:
        clip_grad_norm([make_model()], 1.0)
    except TypeError as error:
        return str(error)
    return "accepted"


def test_clip_grad_norm_refuses_a_model_the_adapter_did_not_wrap() -> None:
    for message in run_distributed(_clip_refusal_worker, 2, timeout=60):
        assert message.startswith("model_chunks: ToyModel is not a chunk wrapped by"), message
