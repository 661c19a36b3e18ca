"""Which worlds a run consists of, in the order they run.

Cells (world size, config, precision) run one after another; inside a cell the repetitions
run back to back and, inside each repetition, the implementations in the order given (ours,
FSDP2, the no-comm reference): A B R A B R ..., each a fresh process world. Only the first
repetition is instrumented (memory, collectives): instrumentation never touches a timed step,
and memory figures are deterministic, so once is enough.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from benchmarks.configs import CONFIGS, QUICK_CONFIGS, ModelConfig, RunSpec

QUICK = {"steps": 3, "warmup": 1, "reps": 1}


@dataclass(frozen=True)
class Settings:
    """The resolved knobs of a run (``--quick`` applied)."""

    device: str
    worlds: list[int]
    configs: dict[str, ModelConfig]
    steps: int
    warmup: int
    reps: int

    @classmethod
    def resolve(cls, args: argparse.Namespace, device: str, worlds: list[int]) -> Settings:
        if args.quick:
            return cls(device, worlds, QUICK_CONFIGS, QUICK["steps"], QUICK["warmup"], 1)
        return cls(device, worlds, CONFIGS, args.steps, args.warmup, args.reps)

    def describe(self, threads: int, optimizer_step: str) -> str:
        return (
            f"{self.reps} rep(s) per implementation, {self.steps} timed steps after "
            f"{self.warmup} warm-up step(s) (plus 1 warm-up and 1 instrumented step in the"
            f" first rep), {threads} torch thread(s) per rank, ZeRO-3 (FSDP2 default"
            f" reshard_after_forward), AdamW (ours: {optimizer_step} step)"
        )


def benchmark_worlds(args: argparse.Namespace, s: Settings) -> list[tuple[int, RunSpec]]:
    plan = []
    for world in s.worlds:
        for name in args.configs:
            for precision in args.precisions:
                for rep in range(s.reps):
                    for impl in args.impls:
                        spec = RunSpec(
                            impl=impl,
                            model=s.configs[name],
                            precision=precision,
                            world_size=world,
                            warmup=s.warmup,
                            steps=s.steps,
                            device_type=s.device,
                            instrument=rep == 0,
                            instrument_warmup=1,
                            grad_allocator=args.grad_allocator,
                            host_transport=args.host_transport,
                            backward_prefetch_grad_fraction=args.backward_prefetch_fraction,
                            contiguous_step=args.optimizer_step == "contiguous",
                            prefetch_depth=args.prefetch_depth,
                            merge_blocks=args.merge_blocks,
                            serial_reductions=args.serial_reductions,
                            quantize_comms=args.quantize_comms,
                            reshard_after_forward=args.reshard_after_forward,
                            hsdp_outer=args.hsdp_outer,
                            outer_optim=args.outer_optim,
                            tp=args.tp,
                            float8=args.float8,
                        )
                        plan.append((rep, spec))
    return plan


def profile_worlds(args: argparse.Namespace, s: Settings, out_dir: str) -> list[RunSpec]:
    """Profiled worlds: the headline config at the first world size, every precision."""
    if not args.profile:
        return []
    name = "default" if "default" in args.configs else args.configs[0]
    return [
        RunSpec(
            impl=impl,
            model=s.configs[name],
            precision=precision,
            world_size=s.worlds[0],
            warmup=1,
            steps=args.profile_steps,
            device_type=s.device,
            profile_dir=out_dir,
            grad_allocator=args.grad_allocator,
            host_transport=args.host_transport,
            backward_prefetch_grad_fraction=args.backward_prefetch_fraction,
            contiguous_step=args.optimizer_step == "contiguous",
            prefetch_depth=args.prefetch_depth,
            merge_blocks=args.merge_blocks,
            serial_reductions=args.serial_reductions,
            quantize_comms=args.quantize_comms,
            reshard_after_forward=args.reshard_after_forward,
            hsdp_outer=args.hsdp_outer,
            outer_optim=args.outer_optim,
            tp=args.tp,
            float8=args.float8,
        )
        for precision in args.precisions
        for impl in ("ours", "fsdp2", "local")
    ]
