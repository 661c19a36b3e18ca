"""``fully_shard``'s checks of its scalar arguments: each raises naming the argument and
the fix, before anything is sharded or communicated."""

from __future__ import annotations

from typing import Any

__all__ = ["check_numel_caps", "check_overlap_options", "refuse_unknown_arguments"]


def _require_positive_int(value: object, argument: str, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{argument} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{argument}={value}: {fix}")


def _require_fraction(value: object, argument: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{argument} must be a float in [0, 1], got {value!r}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            f"{argument}={value} is outside [0, 1]: 0.0 prefetches at the unit's pre-backward, "
            "1.0 once all of its gradients arrived"
        )


def check_overlap_options(
    max_inflight_reductions: object, prefetch_depth: object, backward_prefetch_grad_fraction: object
) -> None:
    _require_positive_int(
        max_inflight_reductions,
        "max_inflight_reductions",
        "at least 1 reduction must be allowed in flight "
        "(use overlap_grad_reduce=False to wait for each one)",
    )
    _require_positive_int(
        prefetch_depth,
        "prefetch_depth",
        "gather at least the next unit ahead, or turn prefetching off with "
        "overlap_param_gather=False",
    )
    _require_fraction(backward_prefetch_grad_fraction, "backward_prefetch_grad_fraction")


def refuse_unknown_arguments(unsupported: dict[str, Any]) -> None:
    if unsupported:
        names = ", ".join(sorted(unsupported))
        raise TypeError(
            f"fully_shard() got unsupported argument(s) {names}: they are not implemented yet"
        )


def check_numel_caps(**caps: object) -> None:
    for name, value in caps.items():
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise ValueError(f"{name} must be a number of elements >= 0 or None, got {value!r}")


def check_flag(value: object, argument: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{argument} must be True or False, got {value!r}")
