"""ZeRO sharding strategies, accepted as the seed README spells them: an int or a name."""

from __future__ import annotations

import enum


class ShardingStrategy(enum.IntEnum):
    """How much of the training state is sharded over the data-parallel shard group."""

    NO_SHARD = 0
    OPTIM = 1
    OPTIM_GRADS = 2
    OPTIM_GRADS_PARAMS = 3

    @property
    def shards_optimizer_state(self) -> bool:
        return self >= ShardingStrategy.OPTIM

    @property
    def shards_grads(self) -> bool:
        return self >= ShardingStrategy.OPTIM_GRADS

    @property
    def shards_params(self) -> bool:
        return self == ShardingStrategy.OPTIM_GRADS_PARAMS


_NAMES = {s.name.lower(): s for s in ShardingStrategy}


def parse_strategy(value: int | str | ShardingStrategy, argument: str) -> ShardingStrategy:
    """Turn ``value`` into a strategy or raise an error that names ``argument`` and the choices."""
    if isinstance(value, ShardingStrategy):
        return value
    if isinstance(value, bool):
        raise TypeError(f"{argument} must be an int 0-3 or a strategy name, got {value!r}")
    if isinstance(value, int):
        if 0 <= value <= 3:
            return ShardingStrategy(value)
        raise ValueError(
            f"{argument}={value} is out of range: use 0 (no_shard), 1 (optim), "
            "2 (optim_grads) or 3 (optim_grads_params)"
        )
    if isinstance(value, str):
        try:
            return _NAMES[value.strip().lower()]
        except KeyError:
            raise ValueError(
                f"{argument}={value!r} is not a sharding strategy: use one of {sorted(_NAMES)} "
                "or 0-3"
            ) from None
    raise TypeError(f"{argument} must be an int 0-3 or a strategy name, got {type(value).__name__}")


def check_post_forward_strategy(
    option: str, strategy: ShardingStrategy, strategy_arg: str, alternative: str
) -> None:
    """Keeping a unit's weights over a smaller group between forward and backward (``option``,
    as the caller spells it) is ZeRO-3 only: the other strategies keep them unsharded anyway.
    The error names ``strategy_arg`` and offers ``alternative`` (the caller's other fix)."""
    if strategy != ShardingStrategy.OPTIM_GRADS_PARAMS:
        raise ValueError(
            f"{option} with {strategy_arg}={int(strategy)}: only ZeRO-3 reshards weights after "
            f"forward; pass {strategy_arg}=3 or {alternative}"
        )
