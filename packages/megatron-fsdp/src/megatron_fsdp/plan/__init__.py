"""Plans made before a run, with no process group and no parameter memory: a rank's peak
through a training step and what it holds between steps (``plan_memory``), read off the
engine run for that rank on fake tensors. ``python -m megatron_fsdp.plan`` prints one from
the command line."""

from megatron_fsdp.plan.memory import MEMORY_CATEGORIES, MemoryPlan, PhaseBytes, plan_memory

__all__ = ["MEMORY_CATEGORIES", "MemoryPlan", "PhaseBytes", "plan_memory"]
