"""Train a Hugging Face Llama with ``transformers.Trainer`` and megatron-fsdp.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --output-dir /tmp/hf_trainer

``nox -s hf_trainer`` runs it on 2 CPU ranks (gloo; NCCL and CUDA when a GPU is present).
Nothing comes from a model hub: the model is a small ``LlamaForCausalLM`` built from a config
and the data are byte tokens of generated arithmetic lines.

The only change from a plain Trainer script is the class:
``MegatronFSDPTrainer(..., megatron_fsdp=MegatronFSDPConfig(zero_dp_strategy=3))`` shards the
model (one unit per ``LlamaDecoderLayer``, found from the model's ``_no_split_modules``) and
its optimizer. Gradient accumulation, clipping, the cosine schedule, ``evaluate()`` and
``--bf16`` autocast are Trainer's own. Every ``--save-steps`` a checkpoint folder is written
(the sharded model and optimizer as one atomic DCP checkpoint under ``megatron_fsdp/``);
start the same command again with ``--resume`` and it continues from the newest one. At the
end ``trainer.save_model()`` writes ``config.json`` + ``model.safetensors``, which
``LlamaForCausalLM.from_pretrained`` loads here and checks against the sharded model's logits.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from megatron_fsdp.integrations.transformers import MegatronFSDPConfig, MegatronFSDPTrainer


class ArithmeticBytes(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Windows of ``context`` byte tokens over lines like ``"17 + 25 = 42"``."""

    def __init__(self, lines: int, context: int, seed: int) -> None:
        rng = random.Random(seed)
        text = "\n".join(
            f"{a} + {b} = {a + b}"
            for a, b in ((rng.randrange(90), rng.randrange(90)) for _ in range(lines))
        )
        self.data = torch.tensor(list(text.encode()), dtype=torch.long)
        self.context = context

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.context

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.data[index * self.context : (index + 1) * self.context]
        return {"input_ids": window, "labels": window}


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)  # every rank builds the same weights
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,  # bytes: no tokenizer download
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=False,
        )
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("hf_trainer_out"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-steps", type=int, default=20)
    parser.add_argument("--zero", type=int, default=3, choices=[0, 1, 2, 3])
    parser.add_argument("--api", default="seed", choices=["seed", "per_module"])
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (Trainer's own)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    training = TrainingArguments(
        output_dir=str(args.output_dir),
        max_steps=args.steps,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=5,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=args.save_steps,
        save_steps=args.save_steps,
        use_cpu=not torch.cuda.is_available(),
        bf16=args.bf16,
        report_to=[],
        seed=0,
    )
    trainer = MegatronFSDPTrainer(
        model=tiny_llama(),
        args=training,
        train_dataset=ArithmeticBytes(lines=3000, context=64, seed=0),
        eval_dataset=ArithmeticBytes(lines=200, context=64, seed=1),
        megatron_fsdp=MegatronFSDPConfig(api=args.api, zero_dp_strategy=args.zero),
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    final = args.output_dir / "final"
    trainer.save_model(str(final))  # collective: every rank calls it

    probe = torch.arange(48, device=training.device).reshape(2, 24) + 40
    with torch.no_grad():
        sharded = trainer.model(probe).logits.float()  # collective too
    if dist.get_rank() == 0:
        reloaded = LlamaForCausalLM.from_pretrained(final).to(training.device)
        with torch.no_grad():
            difference = (reloaded(probe).logits.float() - sharded).abs().max().item()
        print(f"saved to {final}; from_pretrained's max |logit difference| {difference:.2e}")
        if not args.bf16 and difference > 1e-5:
            raise SystemExit(f"the saved model's logits differ by {difference}")


if __name__ == "__main__":
    main()
