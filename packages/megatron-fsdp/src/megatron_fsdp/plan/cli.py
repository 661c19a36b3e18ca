"""``python -m megatron_fsdp.plan``: a memory plan from the command line (``--help``).

The model (``module:callable`` or ``--hf-config``) is built under ``torch.device("meta")``;
the planned step runs on ``--batch`` x ``--seq-len`` token ids.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from megatron_fsdp.plan.memory import plan_memory
from mfsdp_hooks import MixedPrecisionPolicy

__all__ = ["main"]

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_fsdp.plan",
        description="Per-rank peak memory of a training step under fully_shard_model.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="module:callable building the model")
    source.add_argument("--hf-config", help="a Hugging Face config.json (or its directory)")
    parser.add_argument("--world-size", type=int, nargs="+", required=True)
    parser.add_argument("--unit", action="append", default=[], help="unit class name")
    parser.add_argument("--zero", type=int, default=3, choices=(0, 1, 2, 3))
    parser.add_argument("--outer-dp-size", type=int, default=1, help="HSDP replicas")
    parser.add_argument("--hfsdp", action="store_true", help="outer_dp_sharding_strategy=optim")
    parser.add_argument("--compute-dtype", choices=sorted(_DTYPES), default="fp32")
    parser.add_argument("--optimizer", default="adamw", choices=("adam", "adamw", "sgd"))
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="example input: sequences")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    return parser


def _builder(args: argparse.Namespace) -> Callable[[], nn.Module]:
    if args.model:
        module_name, _, attribute = args.model.partition(":")
        if not attribute:
            raise SystemExit(f"--model {args.model!r}: write it as module:callable")
        built: Callable[[], nn.Module] = getattr(importlib.import_module(module_name), attribute)
        return built
    from transformers import AutoConfig, AutoModelForCausalLM  # an optional dependency

    config = AutoConfig.from_pretrained(args.hf_config)
    return lambda: AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]


def _units(model: nn.Module, names: Sequence[str]) -> list[type[nn.Module]]:
    found = {type(m).__name__: type(m) for m in model.modules()}
    missing = [name for name in names if name not in found]
    if missing:
        raise SystemExit(f"--unit {missing}: no module of that class in the model")
    return [found[name] for name in names]


def _loss(output: Any) -> torch.Tensor:
    logits: torch.Tensor = output.logits if hasattr(output, "logits") else output
    return logits.float().logsumexp(-1).mean()


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    with torch.device("meta"):
        model = _builder(args)()
    units = _units(model, args.unit)
    policy = MixedPrecisionPolicy(param_dtype=_DTYPES[args.compute_dtype])
    tokens = torch.zeros(args.batch, args.seq_len, dtype=torch.long, device="meta")
    for world in args.world_size:
        plan = plan_memory(
            model,
            world_size=world,
            example_inputs=(tokens,),
            loss_fn=_loss,
            optimizer=args.optimizer,
            fsdp_unit_modules=units,
            zero_dp_strategy=args.zero,
            mixed_precision_policy=policy,
            outer_dp_size=args.outer_dp_size,
            outer_dp_sharding_strategy="optim" if args.hfsdp else 0,
            device=args.device,
        )
        print(plan)
