"""Megatron-Core's own ``GPTModel`` through ``megatron_fsdp.mcore.FullyShardedDataParallel``
with Megatron-Core's parallelisms (issue 29), driven by ``get_forward_backward_func()`` with
``config.no_sync_func`` and ``config.finalize_model_grads_func`` wired as Megatron-LM's
``training.py`` wires them for Megatron-FSDP: pipeline (1F1B), virtual pipeline, HSDP
(``num_distributed_optimizer_instances=2``), tensor parallelism (FSDP over the DP group, the
TP group from Megatron-Core; also with SwiGLU, whose ``linear_fc1`` is a strided partition,
``partition_stride=2``), tensor + sequence parallelism (the sequence-parallel norms'
gradients summed over TP by Megatron-Core's ``finalize_model_grads`` on our sharded
gradients), expert parallelism (a MoE model, its experts sharded over the expert-data-parallel
group) and TP x PP x DP on 8 ranks; each at ZeRO-3 (``optim_grads_params``) and ZeRO-1
(``optim``).

Each layout trains 10 AdamW steps, its gradients clipped to a norm of 0.5 over the whole
model every step (``megatron_fsdp.mcore_grad_norm.clip_grad_norm``; one process:
``torch.nn.utils.clip_grad_norm_``), and must match one unsharded process running the same
``GPTModel`` with TP=PP=1 on the same global batches within 1e-5: the last stage's loss each
step, and the norm before clipping on every rank. The stages start from the reference's
initial weights (a stage's layer ``i`` is the whole model's layer ``layer_number - 1``):
Megatron-Core initialises a stage's layers from its own RNG stream, so the same seed alone
would not give the same weights. Needs megatron-core (``nox -s mcore``); skipped elsewhere.

CPU workarounds (test-only; Megatron-Core assumes CUDA): ``tests/mcore_cpu.py`` for the
schedules' CUDA devices; the local attention's score buffer is put in Megatron-Core's global
memory buffer on the CPU, as ``examples/mcore_gpt.py`` explains; ``batch_p2p_comm=False``
(gloo has no batched P2P).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="megatron-core is not installed (nox -s mcore)")

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": on purpose
    warnings.simplefilter("ignore", UserWarning)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer

from mcore_cpu import CudaOnCpu, define_missing_te_gemm, point_cuda_device_at_cpu

from megatron_fsdp.mcore import FullyShardedDataParallel
from megatron_fsdp.mcore_checkpoint import load_fsdp_dtensor, save_fsdp_dtensor
from megatron_fsdp.mcore_grad_norm import clip_grad_norm
from mfsdp_checkpoint import describe
from mfsdp_collectives.testing import run_distributed

VOCAB, SEQ, LAYERS, HIDDEN = 64, 16, 4, 32
GLOBAL_BATCH, N_MICRO, STEPS, SEED, LR = 8, 2, 10, 1234, 3e-3
MAX_NORM = 0.5  # below the gradients' norms here: every step clips
RTOL = 1e-5
EXPERTS = 4
# A MoE model's settings (each layer's MLP is EXPERTS experts, the local spec's SequentialMLP):
# the all-gather token dispatcher (plain collectives, no CUDA kernels), no auxiliary loss (the
# loss is the language model's alone).
MOE: dict[str, Any] = {
    "num_moe_experts": EXPERTS,
    "moe_router_topk": 2,
    "moe_token_dispatcher_type": "allgather",
    "moe_aux_loss_coeff": 0.0,
    # Megatron-Core 0.16.1's SequentialMLP adds a bias in place to the output of its row-
    # parallel layer, which autograd refuses at TP=1 ("Output 0 of
    # _ReduceFromModelParallelRegion is a view and is being modified inplace"): no biases.
    "add_bias_linear": False,
}
MASK = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(diagonal=1).view(1, 1, SEQ, SEQ)


@dataclass(frozen=True)
class Layout:
    ranks: int
    stages: int = 1  # pipeline_model_parallel_size
    virtual: int | None = None  # virtual_pipeline_model_parallel_size
    instances: int = 1  # num_distributed_optimizer_instances (HSDP)
    tp: int = 1  # tensor_model_parallel_size
    ep: int = 1  # expert_model_parallel_size (a MoE model with EXPERTS experts when > 1)
    moe: bool = False  # a MoE model at ep=1 (all EXPERTS experts on every rank)
    swiglu: bool = False  # gated_linear_unit with SiLU: linear_fc1 holds [w; v] per TP rank
    sequence_parallel: bool = False
    groups_from: str = "pg_collection"  # or "parallel_state" (pg_collection=None)


LAYOUTS: dict[str, Layout] = {
    "pp2_dp2": Layout(4, stages=2),
    "pp2_vpp2_dp1": Layout(2, stages=2, virtual=2, groups_from="parallel_state"),
    "dp_outer2_dp_shard2": Layout(4, instances=2),
    "tp2_dp2": Layout(4, tp=2, groups_from="parallel_state"),
    "tp2_sp_dp2": Layout(4, tp=2, sequence_parallel=True),
    "tp2_dp2_swiglu": Layout(4, tp=2, swiglu=True),
    "ep2_dp2": Layout(4, ep=2),
    "tp2_pp2_dp2": Layout(8, stages=2, tp=2),
    "dp4": Layout(4),
}
# Layouts only checkpoints resume at (the matrix above covers their kind already).
RESUME_LAYOUTS = {
    **LAYOUTS,
    "moe_dp2": Layout(2, moe=True),
    "dp2": Layout(2),
    "dp4_swiglu": Layout(4, swiglu=True),
}


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """Test-only stand-in for apex's ``FusedLayerNorm`` / TE's ``TENorm``: Megatron-Core's
    local spec builds its norms as ``WrappedTorchNorm`` without them, which refuses sequence
    parallelism ("sequence parallel not supported by torch LayerNorm",
    megatron/core/transformer/torch_norm.py). Like those, it marks its parameters
    ``sequence_parallel``, so ``finalize_model_grads`` sums their gradients over TP."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def _layer_specs(config: TransformerConfig) -> Any:
    """Megatron-Core's local spec; under sequence parallelism with the norms above."""
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if not config.sequence_parallel:
        return spec
    spec.submodules.input_layernorm = SequenceParallelLayerNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelLayerNorm
    return TransformerBlockSubmodules(
        layer_specs=[spec] * config.num_layers, layer_norm=SequenceParallelLayerNorm
    )


def _config(layout: Layout | None = None, moe: bool = False) -> TransformerConfig:
    layout = layout or Layout(1)
    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=2 * HIDDEN,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_model_parallel_size=layout.stages,
        virtual_pipeline_model_parallel_size=layout.virtual,
        tensor_model_parallel_size=layout.tp,
        sequence_parallel=layout.sequence_parallel,
        expert_model_parallel_size=layout.ep,
        **(MOE if layout.ep > 1 or layout.moe or moe else {}),
        **({"gated_linear_unit": True, "activation_func": F.silu} if layout.swiglu else {}),
        pipeline_dtype=torch.float32,
        batch_p2p_comm=False,
    )


def _gpt(config: TransformerConfig, pre: bool, post: bool, vp_stage: int | None) -> GPTModel:
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(
        SEED, inference_rng_tracker=True, force_reset_rng=True
    )
    largest = GLOBAL_BATCH * config.num_attention_heads * SEQ * SEQ
    buffers = parallel_state.get_global_memory_buffer().buffer
    buffers[("mpu", torch.float32)] = torch.empty(largest)
    return GPTModel(
        config=config,
        transformer_layer_spec=_layer_specs(config),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=False,
        vp_stage=vp_stage,
    )


def _batch(step: int) -> torch.Tensor:
    """Sequences that count up from a random token by a random stride (learnable)."""
    generator = torch.Generator().manual_seed(SEED + step)
    starts = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=generator)
    strides = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=generator)
    return (starts + strides * torch.arange(SEQ + 1)) % VOCAB


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _reference_worker(
    rank: int, world: int, moe: bool, weight_decay: float, swiglu: bool
) -> tuple[list[float], list[float], dict[str, list[Any]]]:
    point_cuda_device_at_cpu()
    define_missing_te_gemm()
    parallel_state.initialize_model_parallel(1, 1)
    model = _gpt(_config(Layout(1, swiglu=swiglu), moe=moe), True, True, None)
    initial = {k: v.tolist() for k, v in _tensors(model).items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=weight_decay)
    losses, norms = [], []
    for step in range(STEPS):
        tokens = _batch(step)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(SEQ).expand_as(inputs)
        loss = model(inputs, positions, attention_mask=MASK, labels=labels).float().mean()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, initial


@functools.cache
def _reference(
    moe: bool, weight_decay: float = 0.01, swiglu: bool = False
) -> tuple[list[float], list[float], dict[str, list[Any]]]:
    """One process: the dense model (SwiGLU or not), or the MoE one with all EXPERTS experts
    local."""
    result: tuple[list[float], list[float], dict[str, list[Any]]] = run_distributed(
        _reference_worker, 1, moe, weight_decay, swiglu, timeout=180
    )[0]
    return result


def _global_key(model: GPTModel, key: str) -> str:
    """The whole model's name of a stage's tensor: its layer by global number, its expert by
    global index (this rank holds EXPERTS / EP consecutive experts)."""
    if not key.startswith("decoder.layers."):
        return key
    _, _, index, rest = key.split(".", 3)
    number = model.decoder.layers[int(index)].layer_number
    marker = "mlp.experts.local_experts."
    if rest.startswith(marker):
        local, tail = rest.removeprefix(marker).split(".", 1)
        per_rank = EXPERTS // parallel_state.get_expert_model_parallel_world_size()
        first = parallel_state.get_expert_model_parallel_rank() * per_rank
        rest = f"{marker}{first + int(local)}.{tail}"
    return f"decoder.layers.{number - 1}.{rest}"


def _stage_from(model: GPTModel, initial: dict[str, list[Any]]) -> None:
    """Load the whole model's initial weights into this stage (``_global_key``), a
    tensor-parallel parameter's slice along its ``partition_dim`` (Megatron-Core's layouts
    cut evenly there, the fused QKV weight by whole query groups; a strided one, SwiGLU's
    ``linear_fc1``, in each of its ``partition_stride`` blocks)."""
    tp, tp_rank = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )
    params = dict(model.named_parameters())
    state = {}
    for key in _tensors(model):
        value = torch.tensor(initial[_global_key(model, key)])
        param = params.get(key)
        if param is not None and getattr(param, "tensor_model_parallel", False):
            dim, blocks = param.partition_dim, getattr(param, "partition_stride", 1)
            # A strided partition (SwiGLU's [w; v]): this rank's slice of each block.
            value = torch.cat([b.chunk(tp, dim=dim)[tp_rank] for b in value.chunk(blocks, dim)])
        state[key] = value
    model.load_state_dict(state, strict=False)


def _chunks(layout: str, zero: str, initial: dict[str, list[Any]]) -> list[Any]:
    spec = RESUME_LAYOUTS[layout]
    virtual = spec.virtual
    config = _config(spec)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=zero,
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        num_distributed_optimizer_instances=spec.instances,
    )
    pg_collection = None
    if spec.groups_from == "pg_collection":
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    chunks = []
    for vp_stage in range(virtual or 1):
        vp = vp_stage if virtual else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        model = _gpt(config, pre, post, vp)
        _stage_from(model, initial)
        chunks.append(
            FullyShardedDataParallel(
                config,
                ddp_config,
                model,
                fsdp_unit_modules=[TransformerLayer],
                pg_collection=pg_collection,
            )
        )
    # As Megatron-LM's training.py does for Megatron-FSDP with --overlap-grad-reduce.
    config.no_sync_func = [chunk.no_sync for chunk in chunks]
    if len(chunks) == 1:
        config.no_sync_func = config.no_sync_func[0]
    config.finalize_model_grads_func = finalize_model_grads
    return chunks


def _forward_step(data: Iterator[torch.Tensor], model: Any) -> tuple[torch.Tensor, Any]:
    tokens = next(data)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ).expand_as(inputs)
    output = model(inputs, positions, attention_mask=MASK, labels=labels)

    def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = per_token.float().mean()
        # A copy: the schedule divides the returned loss in place by the micro-batches.
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def _start(layout: str, zero: str, initial: dict[str, list[Any]]) -> list[Any]:
    """Megatron-Core's groups for ``layout``, and its chunks wrapped by the adapter."""
    point_cuda_device_at_cpu()
    define_missing_te_gemm()
    spec = RESUME_LAYOUTS[layout]
    parallel_state.initialize_model_parallel(
        spec.tp,
        spec.stages,
        virtual_pipeline_model_parallel_size=spec.virtual,
        expert_model_parallel_size=spec.ep,
        num_distributed_optimizer_instances=spec.instances,
    )
    return _chunks(layout, zero, initial)


def _torch_steps(
    chunks: list[Any], optimizers: list[torch.optim.Optimizer]
) -> tuple[Callable[[], None], Callable[[], None]]:
    """A step's start and end with torch optimizers, one per chunk, as Megatron-Core's
    ``DistributedOptimizer`` does them for Megatron-FSDP chunks."""

    def zero_grad() -> None:
        for chunk, optimizer in zip(chunks, optimizers, strict=True):
            chunk.zero_grad_buffer()
            optimizer.zero_grad()

    def step() -> None:
        for chunk, optimizer in zip(chunks, optimizers, strict=True):
            optimizer.step()
            chunk.param_and_grad_buffer.copy_main_weights_to_model_weights()
            chunk.start_param_sync()

    return zero_grad, step


def _train(
    chunks: list[Any],
    steps: tuple[int, int],
    zero_grad: Callable[[], None],
    optimizer_step: Callable[[], None],
) -> tuple[list[float], list[float]]:
    """Global batches ``steps[0]`` to ``steps[1] - 1`` through Megatron-Core's schedule, the
    gradients clipped over the whole model; the last stage's losses and every step's norm."""
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    losses, norms = [], []
    for step in range(*steps):
        zero_grad()
        local = _batch(step).chunk(dp_size)[dp_rank]
        data = [iter(local.chunk(N_MICRO)) for _ in chunks]
        with CudaOnCpu():
            reduced = get_forward_backward_func()(
                forward_step_func=_forward_step,
                data_iterator=data if len(chunks) > 1 else data[0],
                model=chunks if len(chunks) > 1 else chunks[0],
                num_microbatches=N_MICRO,
                seq_length=SEQ,
                micro_batch_size=local.shape[0] // N_MICRO,
            )
        norms.append(clip_grad_norm(chunks, MAX_NORM).item())
        with CudaOnCpu():
            optimizer_step()
        if reduced:  # the last pipeline stage: the global batch's mean loss
            loss = torch.stack([r["loss"] for r in reduced]).mean()
            # Every data-parallel rank (with several optimizer instances the default group
            # is one instance's).
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            dist.all_reduce(loss, group=group)
            losses.append(loss.item() / dist.get_world_size(group))
    return losses, norms


def _worker(
    rank: int,
    world: int,
    layout: str,
    zero: str,
    initial: dict[str, list[Any]],
    steps: tuple[int, int] = (0, STEPS),
    load_from: str | None = None,
    save_to: str | None = None,
) -> tuple[list[float], list[float]]:
    """Train steps ``steps[0]`` to ``steps[1] - 1``; first resume from ``load_from``, last
    save to ``save_to`` (every chunk and optimizer: ``megatron_fsdp.mcore_checkpoint``)."""
    chunks = _start(layout, zero, initial)
    optimizers = [torch.optim.AdamW(chunk.parameters(), lr=LR) for chunk in chunks]
    if load_from is not None:
        loaded = load_fsdp_dtensor(load_from, chunks, optimizers)
        assert loaded["iteration"] == steps[0], loaded
    losses, norms = _train(chunks, steps, *_torch_steps(chunks, optimizers))
    if save_to is not None:
        save_fsdp_dtensor(save_to, chunks, optimizers, iteration=steps[1])
    parallel_state.destroy_model_parallel()
    return losses, norms


@pytest.mark.parametrize("zero", ["optim_grads_params", "optim"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gpt_through_the_adapter_matches_one_process(layout: str, zero: str) -> None:
    want, want_norms, initial = _reference(LAYOUTS[layout].ep > 1, swiglu=LAYOUTS[layout].swiglu)
    ranks = LAYOUTS[layout].ranks
    results = run_distributed(_worker, ranks, layout, zero, initial, timeout=300)
    for _, norms in results:  # every rank: the whole model's norm, clipped the same way
        got = torch.tensor(norms, dtype=torch.float64)
        expected = torch.tensor(want_norms, dtype=torch.float64)
        assert torch.allclose(got, expected, rtol=RTOL, atol=0), (layout, zero, got, expected)
    assert min(want_norms) > MAX_NORM  # so every step's clipping is exercised
    last_stage = [losses for losses, _ in results if losses]
    assert len(last_stage) == ranks // LAYOUTS[layout].stages  # every rank of the last stage
    for losses in last_stage:
        got = torch.tensor(losses, dtype=torch.float64)
        expected = torch.tensor(want, dtype=torch.float64)
        assert torch.allclose(got, expected, rtol=RTOL, atol=0), (layout, zero, got, expected)
    assert want[-1] < want[0]  # it learns


RESUMES = [
    ("tp2_dp2", "dp4"),
    ("tp2_dp2", "pp2_dp2"),
    ("dp4", "tp2_dp2"),
    ("tp2_dp2", "dp_outer2_dp_shard2"),
    ("pp2_vpp2_dp1", "tp2_pp2_dp2"),
    ("ep2_dp2", "moe_dp2"),
    ("tp2_dp2_swiglu", "dp4_swiglu"),
]


@pytest.mark.parametrize(("saved_at", "resumed_at"), RESUMES)
def test_a_checkpoint_resumes_at_another_layout(
    saved_at: str, resumed_at: str, tmp_path: Path
) -> None:
    """Model and optimizer state saved as Megatron-LM's fsdp_dtensor checkpoints
    (``save_fsdp_dtensor``: whole-model names, DTensors of the whole model's shapes) after 5
    steps at one layout load at another and the next 5 steps continue one process's curve
    within 1e-5: TP slices gathered and re-cut by DCP (TP=2 x DP=2 <-> DP=4), stage-local
    layers renamed by their global number (TP=2 x DP=2 -> PP=2 x DP=2; two virtual chunks on
    two stages -> TP=2 x PP=2 x DP=2), experts by their global index (EP=2 -> every expert on
    every rank), TP=2 x DP=2 -> HSDP, and a SwiGLU model's linear_fc1 saved as Megatron-LM
    saves it (``_w`` and ``_v``, each TP rank's halves stacked) from TP=2 to TP=1."""
    saved, resumed = RESUME_LAYOUTS[saved_at], RESUME_LAYOUTS[resumed_at]
    moe = saved.ep > 1
    assert moe == (resumed.moe or resumed.ep > 1) and saved.swiglu == resumed.swiglu
    want, _, initial = _reference(moe, swiglu=saved.swiglu)
    half, path = STEPS // 2, str(tmp_path / "ckpt")
    ranks = RESUME_LAYOUTS[saved_at].ranks
    zero = "optim_grads_params"
    first = run_distributed(
        _worker, ranks, saved_at, zero, initial, (0, half), None, path, timeout=300
    )
    for losses in [losses for losses, _ in first if losses]:  # the writer matches one process
        got = torch.tensor(losses, dtype=torch.float64)
        expected = torch.tensor(want[:half], dtype=torch.float64)
        assert torch.allclose(got, expected, rtol=RTOL, atol=0), (saved_at, got)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == str(half)
    tensors = describe(str(tmp_path / "ckpt" / f"iter_{half:07d}"))["tensors"]
    keys = [t["key"] for t in tensors if t["key"].startswith("model.")]
    fc1 = [key for key in keys if ".linear_fc1." in key]
    suffixes = ("_w", "_v") if saved.swiglu else ("weight", "bias")
    assert fc1 and all(n.endswith(suffixes) for n in fc1), fc1
    ranks = RESUME_LAYOUTS[resumed_at].ranks
    results = run_distributed(
        _worker, ranks, resumed_at, zero, initial, (half, STEPS), path, None, timeout=300
    )
    last_stage = [losses for losses, _ in results if losses]
    assert len(last_stage) == ranks // RESUME_LAYOUTS[resumed_at].stages
    for losses in last_stage:
        got = torch.tensor(losses, dtype=torch.float64)
        expected = torch.tensor(want[half:], dtype=torch.float64)
        assert torch.allclose(got, expected, rtol=RTOL, atol=0), (saved_at, resumed_at, got)
