"""The ``module.`` prefix a wrapper puts before the inner model's names: the one place that
strips, swaps and detects it (checkpoint namings, full state dicts, ``convert``, Megatron's
optimizer names and the Megatron-Core adapter all ask here)."""

from __future__ import annotations

WRAPPER_PREFIX = "module."
"""What a ``MegatronFSDP`` wrapper (ours, NVIDIA's, Megatron-Core's adapter) puts before the
inner model's names; Megatron's optimizer names carry it two or three times."""


def rename_model(name: str, source_prefix: str, target_prefix: str) -> str:
    """``name`` written with ``source_prefix`` rewritten with ``target_prefix`` (a name
    without ``source_prefix`` only gains ``target_prefix``; ``""`` strips or adds nothing)."""
    return target_prefix + name.removeprefix(source_prefix)


def split_wrappers(name: str) -> tuple[str, str]:
    """``name`` as (its leading ``module.`` levels, the model's own path)."""
    rest = name
    while rest.startswith(WRAPPER_PREFIX):
        rest = rest[len(WRAPPER_PREFIX) :]
    return name[: len(name) - len(rest)], rest


def bare(name: str) -> str:
    """``name`` without its leading ``module.`` levels: the model's own path."""
    return split_wrappers(name)[1]


def prefix_of(names: list[str]) -> str:
    """``"module."`` when every one of ``names`` carries the wrapper prefix, else ``""``."""
    if names and all(n.startswith(WRAPPER_PREFIX) for n in names):
        return WRAPPER_PREFIX
    return ""
