"""Megatron-Core's own interleaved (virtual) pipeline schedule over model chunks sharded by
the seed API (issue 28): ``fully_shard_model`` on each chunk, the chunks' ``no_sync``,
``start_grad_sync`` and ``finish_grad_sync`` called by Megatron-Core's
``forward_backward_pipelining_with_interleaving`` and ``finalize_model_grads`` exactly as
Megatron-LM's ``training.py`` wires them for Megatron-FSDP (``config.no_sync_func``, and
``config.grad_sync_func`` under ``--align-grad-reduce``).

4 gloo ranks as pp=2 x dp=2 with ``virtual_pipeline_model_parallel_size=2``: four chunks,
two per rank; 10 AdamW steps of 4 micro-batches must match one process training the four
chunks in a row on the same global batches (losses and final weights within 1e-5).
Needs megatron-core (``nox -s mcore`` installs it); skipped elsewhere.

CPU workarounds for Megatron-Core's CUDA-only calls, test-only: ``tests/mcore_cpu.py``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

pytest.importorskip("megatron.core", reason="megatron-core is not installed (nox -s mcore)")

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": on purpose
    warnings.simplefilter("ignore", UserWarning)
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

from mcore_cpu import CudaOnCpu, point_cuda_device_at_cpu

from megatron_fsdp import fully_shard_model, fully_shard_optimizer
from mfsdp_checkpoint import gather_full_state_dict
from mfsdp_collectives import CommTracer
from mfsdp_collectives.testing import run_distributed

VOCAB = WIDTH = 16
SEQ, MICRO_BATCH, N_MICRO = 4, 2, 4
PP, VPP, DP = 2, 2, 2
CHUNKS = PP * VPP
STEPS = 10
RTOL = 1e-5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Chunk(nn.Module):
    """One model chunk with what Megatron-Core's schedules read from a model: ``config``,
    ``model_type``, ``set_input_tensor``, ``pre_process``/``post_process`` and
    ``share_embeddings_and_output_weights``. Activations are ``[seq, batch, hidden]``."""

    def __init__(self, index: int, config: TransformerConfig | None) -> None:
        super().__init__()
        torch.manual_seed(100 + index)
        self.config, self.model_type = config, ModelType.encoder_or_decoder
        self.pre_process, self.post_process = index == 0, index == CHUNKS - 1
        self.share_embeddings_and_output_weights = False
        if self.pre_process:
            self.embed = nn.Embedding(VOCAB, WIDTH)
        self.block = Block()
        if self.post_process:
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | list[torch.Tensor]) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).transpose(0, 1).contiguous() if self.pre_process else None
        x = self.block(x if x is not None else self.input_tensor)
        return self.head(x) if self.post_process else x


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``[seq, batch, vocab]`` logits against ``[batch, seq]``."""
    return F.cross_entropy(logits.transpose(0, 1).reshape(-1, VOCAB), targets.reshape(-1))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    rows = N_MICRO * MICRO_BATCH * DP
    generator = torch.Generator().manual_seed(5)
    return [
        (
            torch.randint(0, VOCAB, (rows, SEQ), generator=generator),
            torch.randint(0, VOCAB, (rows, SEQ), generator=generator),
        )
        for _ in range(STEPS)
    ]


@functools.cache
def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the four chunks in a row, the whole global batch per step."""
    chunks = nn.ModuleList(Chunk(i, None) for i in range(CHUNKS))
    optimizer = torch.optim.AdamW(chunks.parameters(), lr=1e-2)
    losses = []
    for tokens, targets in _batches():
        x = tokens
        for chunk in chunks:
            if not chunk.pre_process:
                chunk.set_input_tensor(x)
            x = chunk(tokens)
        loss = _loss(x, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in chunks.state_dict().items()}


def _wrap_chunks(zero: int, once_per_step: bool) -> tuple[list[Any], TransformerConfig, Any]:
    """This rank's two chunks (virtual stages ``pp_rank`` and ``pp_rank + PP``), each sharded
    by ``fully_shard_model`` over the data-parallel group Megatron-Core made."""
    dp_group = parallel_state.get_data_parallel_group()
    mesh = DeviceMesh.from_group(dp_group, "cpu", mesh_dim_names=("dp_shard",))
    config = TransformerConfig(
        num_layers=CHUNKS,
        hidden_size=WIDTH,
        num_attention_heads=2,
        use_cpu_initialization=True,
        pipeline_model_parallel_size=PP,
        virtual_pipeline_model_parallel_size=VPP,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=False,  # gloo: plain isend/irecv
    )
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = []
    for virtual in range(VPP):
        chunk = Chunk(virtual * PP + pp_rank, config)
        wrapped = fully_shard_model(
            chunk, fsdp_unit_modules=[Block], device_mesh=mesh, zero_dp_strategy=zero
        )
        if once_per_step:  # FSDP2's no_sync: the unsharded gradients wait for the sync
            wrapped.set_reduce_scatter_in_no_sync(False)
        chunks.append(wrapped)
    return chunks, config, dp_group


def _worker(rank: int, world: int, zero: int, align: bool, once_per_step: bool) -> dict[str, Any]:
    point_cuda_device_at_cpu()
    parallel_state.initialize_model_parallel(1, PP, virtual_pipeline_model_parallel_size=VPP)
    chunks, config, dp_group = _wrap_chunks(zero, once_per_step)
    # As Megatron-LM's training.py wires Megatron-FSDP (--overlap-grad-reduce, and
    # --align-grad-reduce for grad_sync_func).
    config.no_sync_func = [chunk.no_sync for chunk in chunks]
    config.grad_sync_func = [chunk.start_grad_sync for chunk in chunks] if align else None
    config.finalize_model_grads_func = finalize_model_grads
    optimizers = [
        fully_shard_optimizer(torch.optim.AdamW(chunk.parameters(), lr=1e-2)) for chunk in chunks
    ]
    dp_rank = dist.get_rank(dp_group)
    losses, reduce_scatters = [], []
    for tokens, targets in _batches():
        mine = tokens.chunk(DP)[dp_rank], targets.chunk(DP)[dp_rank]
        micro = list(zip(mine[0].split(MICRO_BATCH), mine[1].split(MICRO_BATCH), strict=True))
        data = [iter(micro) for _ in chunks]

        def forward_step(data_iterator: Iterator[Any], model: nn.Module) -> tuple[Any, Any]:
            tokens, targets = next(data_iterator)
            output = model(tokens)
            return output, lambda logits: (
                _loss(logits, targets),
                {"loss": _loss(logits, targets).detach()},
            )

        with CommTracer() as tracer, CudaOnCpu():
            reduced = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=data,
                model=chunks,
                num_microbatches=N_MICRO,
                seq_length=SEQ,
                micro_batch_size=MICRO_BATCH,
            )
        reduce_scatters.append(tracer.calls("reduce_scatter"))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        if reduced:  # the last pipeline stage: the global batch's mean loss
            loss = torch.stack([r["loss"] for r in reduced]).mean()
            dist.all_reduce(loss, group=dp_group)
            losses.append(loss.item() / DP)
    weights = {}
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    for virtual, chunk in enumerate(chunks):
        full = gather_full_state_dict(chunk, rank0_only=False)
        index = virtual * PP + pp_rank
        weights.update(
            {f"{index}.{k.removeprefix('module.')}": v.tolist() for k, v in full.items()}
        )
    parallel_state.destroy_model_parallel()
    return {"losses": losses, "weights": weights, "reduce_scatters": reduce_scatters}


@pytest.mark.parametrize("once_per_step", [False, True], ids=["megatron_no_sync", "fsdp2_no_sync"])
@pytest.mark.parametrize("align", [False, True], ids=["no_sync_only", "align_grad_reduce"])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_megatron_core_interleaved_schedule_over_seed_chunks(
    zero: int, align: bool, once_per_step: bool
) -> None:
    results = run_distributed(_worker, PP * DP, zero, align, once_per_step, timeout=180)
    want_losses, want_weights = _reference()
    seen: set[str] = set()
    # Each rank's units: its two blocks, and the root of the chunk that holds the embedding
    # (rank pp=0) or the head (pp=1).
    units = 3
    for rank, result in enumerate(results):
        what = f"zero{zero} align={align} once_per_step={once_per_step} rank {rank}"
        if result["losses"]:
            got = torch.tensor(result["losses"], dtype=torch.float64)
            want = torch.tensor(want_losses, dtype=torch.float64)
            assert torch.allclose(got, want, rtol=RTOL, atol=0), (what, got, want)
        for name, value in result["weights"].items():
            torch.testing.assert_close(
                torch.tensor(value), want_weights[name], rtol=RTOL, atol=1e-7, msg=f"{what} {name}"
            )
        seen |= set(result["weights"])
        # Megatron-FSDP's no_sync reduce-scatters ZeRO-2/3 gradients every micro-batch;
        # FSDP2's (and any ZeRO-1) once per unit per step.
        per_step = units * N_MICRO if zero >= 2 and not once_per_step else units
        assert result["reduce_scatters"] == [per_step] * STEPS, what
    assert seen == set(want_weights)
