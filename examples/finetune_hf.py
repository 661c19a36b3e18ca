"""Fine-tune a Hugging Face Llama with megatron-fsdp, survive a crash, export for from_pretrained.

    torchrun --standalone --nproc-per-node 2 examples/finetune_hf.py --work-dir /tmp/finetune

What it shows, on CPU ranks with gloo (NCCL and CUDA when available), with nothing from a
model hub:

1. The "pretrained" model: a small ``LlamaForCausalLM`` built from a config and written with
   ``save_pretrained`` into ``WORK/base`` (skipped when it is there already, or pass
   ``--base-model DIR`` to start from your own directory).
2. ``from_pretrained`` loads it on every rank and ``megatron_fsdp.fully_shard`` shards the
   model (one unit per ``LlamaDecoderLayer``) and its AdamW optimizer.
3. Every ``--save-every`` steps a DCP checkpoint (model, optimizer, step) is written atomically
   to ``WORK/checkpoints/step_N``. A job that is killed and started again with the same
   command resumes from the newest complete checkpoint; the loss curve continues as if nothing
   had happened. ``--simulate-crash-at N`` kills rank 1 with SIGKILL after step N, once: the
   other rank raises within seconds and the job exits non-zero. (torchrun's
   ``--max-restarts`` restarts it in place with NCCL; with gloo, torch 2.13's restarted
   workers can fail to connect their process group, so start the command again instead.)
4. At the end the trained weights are exported to ``WORK/export`` (``config.json`` and
   ``model.safetensors``), loaded back with ``LlamaForCausalLM.from_pretrained`` and checked
   to give the same logits as the sharded model.

Per-step losses go to ``WORK/losses.jsonl`` (one line per step, appended by rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import mfsdp_checkpoint
from megatron_fsdp import fully_shard
from mfsdp_collectives import disable_host_transport

VOCAB = 256  # byte-level tokens: no tokenizer download


def small_llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def make_base_model(directory: Path) -> None:
    """The stand-in for a hub checkpoint: a seeded random Llama written by save_pretrained."""
    torch.manual_seed(0)
    LlamaForCausalLM(small_llama_config()).save_pretrained(directory)


def fine_tuning_text(sentences: int = 2000, seed: int = 0) -> torch.Tensor:
    """Byte tokens of generated question/answer lines, identical on every rank."""
    rng = random.Random(seed)
    lines = []
    for _ in range(sentences):
        a, b = rng.randrange(50), rng.randrange(50)
        lines.append(f"Q: {a} plus {b}? A: {a + b}.")
    return torch.tensor(list("\n".join(lines).encode()), dtype=torch.long)


def batch_for(data: torch.Tensor, step: int, rank: int, batch: int, context: int) -> torch.Tensor:
    """Rank ``rank``'s sequences of step ``step``: a function of both only, so a resumed job
    sees exactly the batches the crashed one would have."""
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    starts = torch.randint(0, len(data) - context, (batch,), generator=generator)
    return torch.stack([data[s : s + context] for s in starts])


def newest_checkpoint(directory: Path) -> Path | None:
    """The newest ``step_N`` directory. Saves are atomic (a staging directory renamed when
    complete), so every ``step_N`` that exists is whole."""
    steps = sorted(
        (int(p.name.removeprefix("step_")), p)
        for p in directory.glob("step_*")
        if p.name.removeprefix("step_").isdigit()
    )
    return steps[-1][1] if steps else None


def export_and_check(model: torch.nn.Module, export: Path, device: torch.device) -> float:
    """Write ``export`` for from_pretrained (rank 0) and return the largest logit difference
    between the reloaded model and the sharded one on a fixed input."""
    state = mfsdp_checkpoint.gather_full_state_dict(model)  # rank 0 gets the full tensors
    probe = torch.arange(32, device=device).reshape(2, 16) % VOCAB
    with torch.no_grad():
        sharded_logits = model(input_ids=probe).logits.float()
    difference = torch.zeros((), device=device)
    if dist.get_rank() == 0:
        plain = LlamaForCausalLM(small_llama_config())
        plain.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
        plain.save_pretrained(export, safe_serialization=True)
        reloaded = LlamaForCausalLM.from_pretrained(export).to(device)
        with torch.no_grad():
            reloaded_logits = reloaded(input_ids=probe).logits.float()
        difference = (reloaded_logits - sharded_logits).abs().max()
    dist.broadcast(difference, 0)
    return difference.item()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path("finetune_out"))
    parser.add_argument("--base-model", type=Path, default=None, help="a from_pretrained dir")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument(
        "--simulate-crash-at", type=int, default=None, help="SIGKILL rank 1 after this step, once"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    work, checkpoints = args.work_dir, args.work_dir / "checkpoints"
    base = args.base_model or work / "base"
    if rank == 0 and args.base_model is None and not (base / "config.json").exists():
        make_base_model(base)
    dist.barrier()

    module = LlamaForCausalLM.from_pretrained(base).to(device)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr)
    model, optimizer = fully_shard(module, optimizer, fsdp_unit_modules=[LlamaDecoderLayer])

    start = 0
    resume_from = newest_checkpoint(checkpoints)
    if resume_from is not None:
        extra = mfsdp_checkpoint.load_checkpoint(resume_from, model, optimizer, extra={"step": 0})
        start = int(extra["step"])
        if rank == 0:
            print(f"resumed from {resume_from} at step {start}", flush=True)

    data = fine_tuning_text()
    crash_marker = work / "crash_simulated"
    for step in range(start + 1, args.steps + 1):
        tokens = batch_for(data, step, rank, args.batch, args.context).to(device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # equal tokens per rank: the mean of means is the global mean
        mean_loss /= world
        if rank == 0:
            with open(work / "losses.jsonl", "a") as log:
                log.write(json.dumps({"step": step, "loss": mean_loss.item()}) + "\n")
            print(f"step {step}/{args.steps} loss {mean_loss.item():.4f}", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            mfsdp_checkpoint.save_checkpoint(
                checkpoints / f"step_{step}", model, optimizer, extra={"step": step}
            )
        if step == args.simulate_crash_at and not crash_marker.exists():
            dist.barrier()
            if rank == 1:
                crash_marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)  # the others must notice and exit too

    difference = export_and_check(model, work / "export", device)
    if rank == 0:
        print(f"exported to {work / 'export'}; max |logit difference| {difference:.2e}", flush=True)
    disable_host_transport()
    dist.destroy_process_group()
    if difference > 1e-5:
        raise SystemExit(f"the exported model's logits differ by {difference}")


if __name__ == "__main__":
    main()
