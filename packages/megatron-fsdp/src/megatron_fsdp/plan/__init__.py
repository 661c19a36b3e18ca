"""Plans made before a run, with no process group and no parameter memory: what each rank
will hold (``plan_model_states``) and its peak through a training step (``plan_memory``).
``python -m megatron_fsdp.plan`` prints one from the command line."""

from megatron_fsdp.plan.memory import MEMORY_CATEGORIES, MemoryPlan, plan_memory
from megatron_fsdp.plan.model_states import (
    MODEL_STATE_CATEGORIES,
    ModelStatesPlan,
    plan_model_states,
)

__all__ = [
    "MEMORY_CATEGORIES",
    "MODEL_STATE_CATEGORIES",
    "MemoryPlan",
    "ModelStatesPlan",
    "plan_memory",
    "plan_model_states",
]
