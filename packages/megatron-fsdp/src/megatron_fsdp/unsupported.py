"""The one table of what megatron-fsdp does not support yet, keyed by the reference's names.

Every entry point reads it for the names it takes (see the package README, "How data flows
through it"). A config field that is also a ``fully_shard_model`` argument (``nccl_ub``...)
travels on as the argument and is refused there, under the argument's name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = ["NOT_YET", "NotYet", "refuse_unsupported"]

Where = Literal["argument", "ddp_config", "dist_index", "mcore_config"]

# How a refusal names where the setting came from.
_PREFIX: dict[Where, str] = {
    "argument": "",
    "ddp_config": "DistributedDataParallelConfig.",
    "dist_index": "FSDPDistributedIndex.",
    "mcore_config": "config.",
}


@dataclass(frozen=True)
class NotYet:
    """One unsupported setting: where the reference takes it, its default, what it needs."""

    where: Where
    default: object
    feature: str
    """What it would need, as the error says it ("... is not supported yet")."""
    fix: str = ""
    """What to do instead; empty: leave it at its default."""
    also_default: tuple[object, ...] = ()
    """Other values that mean the same as the default (``num_moe_experts=0``)."""

    def accepts(self, value: object) -> bool:
        return value == self.default or value in self.also_default

    def refusal(self, name: str, value: object) -> NotImplementedError:
        fix = self.fix or f"leave it at its default ({self.default!r})"
        return NotImplementedError(
            f"{_PREFIX[self.where]}{name}={value!r}: {self.feature} is not supported yet by "
            f"megatron-fsdp; {fix}"
        )


_MCORE_PARALLELISM = (
    "use megatron_fsdp.fully_shard_model with a device_mesh for context parallelism"
)

NOT_YET: dict[str, NotYet] = {
    # fully_shard_model / fully_shard / MegatronFSDP keyword arguments
    "nccl_ub": NotYet("argument", False, "NCCL user buffers"),
    "fsdp_manual_registration": NotYet("argument", False, "NCCL user-buffer manual registration"),
    "disable_symmetric_registration": NotYet(
        "argument", False, "NCCL user-buffer symmetric registration"
    ),
    "keep_fp8_transpose_cache": NotYet("argument", False, "FP8 parameters"),
    # DistributedDataParallelConfig fields
    "megatron_fsdp_cuda_graph_mode": NotYet("ddp_config", False, "CUDA-graph mode"),
    # FSDPDistributedIndex arguments
    "hybrid_fsdp_expt_group": NotYet("dist_index", None, "a hybrid expert group"),
    "fsdp_group_ag": NotYet("dist_index", None, "a separate all-gather group"),
    "expt_fsdp_group_ag": NotYet("dist_index", None, "a separate expert all-gather group"),
    # Megatron-Core TransformerConfig fields, read by FullyShardedDataParallel
    "context_parallel_size": NotYet(
        "mcore_config",
        1,
        "context parallelism through the Megatron-Core adapter",
        fix=f"{_MCORE_PARALLELISM}, or set context_parallel_size=1",
    ),
}


def refuse_unsupported(where: Where, given: Mapping[str, object] | object) -> None:
    """Raise for the first of ``where``'s names in ``NOT_YET`` that ``given`` (a mapping, or
    an object read by attribute; a name it lacks is at its default) sets otherwise."""
    for name, entry in NOT_YET.items():
        if entry.where != where:
            continue
        if isinstance(given, Mapping):
            value = given.get(name, entry.default)
        else:
            value = getattr(given, name, entry.default)
        if not entry.accepts(value):
            raise entry.refusal(name, value)
