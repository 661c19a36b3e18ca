"""Train Megatron-Core's own ``GPTModel`` through megatron-fsdp's Megatron-Core adapter.

    torchrun --standalone --nproc-per-node 2 examples/mcore_gpt.py [--steps N]

What it shows, on CPU ranks with gloo (no CUDA, no Transformer Engine, no apex):

1. ``megatron.core.parallel_state.initialize_model_parallel(1, 1)`` (no tensor or pipeline
   parallelism: every rank is a data-parallel rank) and a ``GPTModel`` built from a
   ``TransformerConfig`` with ``get_gpt_layer_local_spec()`` (Megatron-Core's own modules).
2. ``megatron_fsdp.mcore.FullyShardedDataParallel`` wraps it as Megatron-Core's
   ``training.py`` does with ``--use-megatron-fsdp``: Megatron-Core's
   ``DistributedDataParallelConfig`` (``optim_grads_params``: parameters, gradients and
   optimizer state sharded), one FSDP unit per ``TransformerLayer``, and the data-parallel
   group from a ``ProcessGroupCollection``.
3. A Megatron-Core-style step: ``zero_grad_buffer``, two micro-batches (the first under
   ``no_sync``), ``finish_grad_sync``, ``scale_gradients``, ``torch.optim.AdamW`` over the
   sharded parameters, ``param_and_grad_buffer.copy_main_weights_to_model_weights()`` and
   ``start_param_sync``. The corpus is synthetic (each sequence counts up from a random
   token with a random stride), so the loss falls quickly; rank 0 prints the mean loss over
   ranks every step and the script exits non-zero unless the loss fell.

``--reference`` trains the same model, from the same seed, on the same global batches and
micro-batches, unsharded in one process with plain PyTorch (run it without torchrun, or with
one process). ``--losses-out PATH`` writes the per-step losses as JSON, so the two runs can
be compared (tests/test_example_mcore_gpt.py does, to 1e-5 relative).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": on purpose
    warnings.simplefilter("ignore", UserWarning)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_fsdp.mcore import FullyShardedDataParallel
from mfsdp_collectives import disable_host_transport

VOCAB = 128
SEQ = 32
GLOBAL_BATCH = 8  # sequences per step, split evenly over the data-parallel ranks
MICRO_BATCHES = 2  # per rank per step
SEED = 1234
# True where a query may not attend (a later key). Megatron-Core builds this mask on CUDA
# when it is given None, so the CPU one is passed in.
CAUSAL_MASK = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(diagonal=1).view(1, 1, SEQ, SEQ)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--reference",
        action="store_true",
        help="train unsharded in one process with plain PyTorch (no FSDP)",
    )
    parser.add_argument(
        "--reference-ranks",
        type=int,
        default=2,
        help="with --reference: the number of ranks of the sharded run it stands for (its "
        "micro-batches are theirs put together)",
    )
    parser.add_argument("--losses-out", type=Path, help="write the per-step losses here (JSON)")
    return parser.parse_args()


def transformer_config() -> TransformerConfig:
    return TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=256,
        hidden_dropout=0.0,  # deterministic: the sharded and reference runs must agree
        attention_dropout=0.0,
        use_cpu_initialization=True,  # weights are created on the CPU (no torch.cuda)
        params_dtype=torch.float32,
    )


def build_model(config: TransformerConfig) -> GPTModel:
    """The same weights on every rank and in the reference: seeded CPU initialisation."""
    torch.manual_seed(SEED)
    # Megatron-Core's seeding. Its default RNG tracker keeps CUDA generator states, which a
    # CPU build of torch has none of; the "inference" tracker records nothing and forks to
    # a null context, which is all the attention-dropout fork needs with dropout 0.
    tensor_parallel.model_parallel_cuda_manual_seed(
        SEED, inference_rng_tracker=True, force_reset_rng=True
    )
    place_attention_buffer_on_cpu(config)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )


def place_attention_buffer_on_cpu(config: TransformerConfig) -> None:
    """Megatron-Core's local ``DotProductAttention`` takes its attention-score buffer from
    ``parallel_state.get_global_memory_buffer()``, which allocates on
    ``torch.cuda.current_device()``; it reuses a buffer that is there and large enough, so
    one on the CPU, sized for the largest micro-batch, keeps attention on the CPU (the
    ``baddbmm`` it feeds has ``beta=0``: its contents are never read)."""
    largest = GLOBAL_BATCH * config.num_attention_heads * SEQ * SEQ
    buffers = parallel_state.get_global_memory_buffer().buffer
    buffers[("mpu", config.params_dtype)] = torch.empty(largest, dtype=config.params_dtype)


def global_batch(step: int) -> torch.Tensor:
    """Step ``step``'s ``GLOBAL_BATCH`` sequences of ``SEQ + 1`` tokens, identical on every
    rank: each counts up from a random token with a random stride of 1 to 3 (modulo the
    vocabulary), so after two tokens the rest of the sequence can be predicted."""
    generator = torch.Generator().manual_seed(SEED + step)
    starts = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=generator)
    strides = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=generator)
    return (starts + strides * torch.arange(SEQ + 1)) % VOCAB


def micro_batches(step: int, rank: int, world: int) -> list[torch.Tensor]:
    """Rank ``rank``'s micro-batches of step ``step``: its equal share of the global batch,
    cut into ``MICRO_BATCHES``."""
    assert GLOBAL_BATCH % (world * MICRO_BATCHES) == 0, "the global batch must split evenly"
    local = global_batch(step).chunk(world)[rank]
    return list(local.chunk(MICRO_BATCHES))


def language_model_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every token of ``tokens`` (GPTModel returns the
    per-token loss when it is given labels)."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(inputs.shape[1]).expand_as(inputs)
    per_token = model(inputs, position_ids, attention_mask=CAUSAL_MASK, labels=labels)
    return per_token.float().mean()


def train_sharded(args: argparse.Namespace) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = transformer_config()
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
    )
    pg_collection = ProcessGroupCollection()
    pg_collection.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    pg_collection.tp = parallel_state.get_tensor_model_parallel_group()
    model = FullyShardedDataParallel(
        config,
        ddp_config,
        build_model(config),
        fsdp_unit_modules=[TransformerLayer],
        pg_collection=pg_collection,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    losses = []
    for step in range(args.steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        total = torch.zeros(())
        micro = micro_batches(step, rank, world)
        for index, tokens in enumerate(micro):
            last = index == len(micro) - 1
            # Gradients of all but the last micro-batch stay local; the last one's backward
            # reduces (reduce-scatters) the accumulated gradients, as Megatron-Core's
            # forward_backward_func does.
            with contextlib.nullcontext() if last else model.no_sync():
                loss = language_model_loss(model, tokens)
                loss.backward()
            total += loss.detach()
        model.finish_grad_sync()
        # The loss of each micro-batch is its mean, summed over micro-batches by backward:
        # scale to the mean over micro-batches (the reduction averaged over ranks already).
        model.scale_gradients(1 / len(micro))
        optimizer.step()
        model.param_and_grad_buffer.copy_main_weights_to_model_weights()
        model.start_param_sync()
        dist.all_reduce(total)  # every rank has as many tokens: the mean of means is the mean
        losses.append(total.item() / world / len(micro))
        if rank == 0:
            print(f"step {step + 1:3d}  loss {losses[-1]:.6f}", flush=True)
    return losses


def train_reference(args: argparse.Namespace) -> list[float]:
    """The same training, unsharded, in this one process: micro-batch ``m`` holds every
    rank's micro-batch ``m`` of the sharded run, so the gradients are the same sums."""
    world = args.reference_ranks
    model = build_model(transformer_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    losses = []
    for step in range(args.steps):
        per_rank = [micro_batches(step, rank, world) for rank in range(world)]
        step_losses = []
        for index in range(MICRO_BATCHES):
            tokens = torch.cat([micro[index] for micro in per_rank])
            loss = language_model_loss(model, tokens) / MICRO_BATCHES
            loss.backward()
            step_losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(step_losses))
        print(f"step {step + 1:3d}  loss {losses[-1]:.6f}  (reference)", flush=True)
    return losses


def main() -> None:
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if "RANK" not in os.environ:  # plain `python examples/mcore_gpt.py --reference`
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.reference and world != 1:
        raise SystemExit("--reference trains in one process: run it without torchrun")
    started = time.perf_counter()
    run = train_reference if args.reference else train_sharded
    losses = run(args)
    if rank == 0:
        print(
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps, "
            f"{time.perf_counter() - started:.1f}s",
            flush=True,
        )
        if args.losses_out is not None:
            args.losses_out.write_text(json.dumps(losses))
    parallel_state.destroy_model_parallel()
    disable_host_transport()
    dist.destroy_process_group()
    if not losses[-1] < losses[0]:
        raise SystemExit(f"the loss did not fall: {losses[0]} -> {losses[-1]}")


if __name__ == "__main__":
    main()
