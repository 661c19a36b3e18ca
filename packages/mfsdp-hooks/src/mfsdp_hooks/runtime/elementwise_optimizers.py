"""Which optimizers may step sharded parameters: those whose update is element-wise (the
package README's "optimizers that need whole matrices" says who is refused, and the fixes).

Stepping each rank's rows equals the rows of the whole parameter's step only when each
element's update reads that element's weight, gradient and state alone (and per-parameter
scalars such as the step count); otherwise an optimizer on shards computes something else and
says nothing (torch FSDP2 as well). The decision is an allow-list, not a list of known
offenders: a refusal names the fix, where an optimizer nobody vouched for could train wrong
without a word. Exact classes only: a subclass may override ``step`` with anything.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TypeVar

import torch

from mfsdp_hooks.config.strategy import ShardingStrategy
from mfsdp_hooks.weights.lookup import locate
from mfsdp_hooks.weights.param_group import ParameterGroup

__all__ = [
    "USER_CLASS_ATTR",
    "declare_elementwise_optimizer",
    "declare_shard_aware_optimizer",
    "is_elementwise_optimizer",
    "refuse_sharded_non_elementwise",
    "steps_shards_exactly",
]

TORCH_ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.ASGD,
    torch.optim.Rprop,
    torch.optim.Adadelta,
)
"""torch's optimizers whose update of an element reads only that element (and scalars)."""

# Fused element-wise optimizers Megatron-Core builds, named so nothing need import them.
_KNOWN_ELEMENTWISE = {
    ("transformer_engine", "FusedAdam"),
    ("transformer_engine", "FusedSGD"),
    ("apex", "FusedAdam"),
    ("apex", "FusedSGD"),
}

_WHY_NOT = {
    "Muon": "it orthogonalises each whole gradient matrix",
    "LBFGS": "it takes dot products over all parameters",
    "Adafactor": "it factors second moments over whole rows and columns",
}

USER_CLASS_ATTR = "_mfsdp_user_class"
"""Set on a class ``attach_optimizer`` derives from the user's: the user's class."""

_declared: dict[type[torch.optim.Optimizer], None] = {}  # an ordered set: membership only
_shard_aware: dict[type[torch.optim.Optimizer], None] = {}


_OptimizerClass = TypeVar("_OptimizerClass", bound=type[torch.optim.Optimizer])


def declare_elementwise_optimizer(cls: _OptimizerClass) -> _OptimizerClass:
    """Declare that ``cls`` (exactly; not its subclasses) updates each element of a
    parameter from that element's weight, gradient and state alone, so that stepping a
    shard of a parameter computes that shard of its step on the whole: sharded training
    then accepts it. Returns ``cls`` (usable as a class decorator). Declaring an optimizer
    that reads whole tensors (norms, matrix products) makes sharded training silently wrong.
    """
    _declared[_optimizer_class(cls, "declare_elementwise_optimizer")] = None
    return cls


def declare_shard_aware_optimizer(cls: _OptimizerClass) -> _OptimizerClass:
    """Declare that ``cls`` (exactly) steps sharded parameters exactly by itself: its step
    reads each parameter's DTensor layout and gathers whatever whole tensors it needs (as
    :class:`mfsdp_hooks.Muon` does with ``map_whole_matrices``). Sharded training then
    accepts it. Returns ``cls`` (usable as a class decorator)."""
    _shard_aware[_optimizer_class(cls, "declare_shard_aware_optimizer")] = None
    return cls


def _optimizer_class(cls: _OptimizerClass, declare: str) -> _OptimizerClass:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"{declare} takes a torch.optim.Optimizer subclass, got {cls!r}")
    return cls


def _user_class(optimizer: torch.optim.Optimizer) -> type[torch.optim.Optimizer]:
    cls = type(optimizer)
    user: type[torch.optim.Optimizer] = cls.__dict__.get(USER_CLASS_ATTR, cls)
    return user


def _wrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The optimizer ``optimizer`` delegates its step to, when it is a wrapper that shares its
    param groups with it (accelerate's ``AcceleratedOptimizer``, which transformers'
    ``Trainer`` builds): the inner one's update is what runs."""
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
        return None
    return inner if inner.param_groups is optimizer.param_groups else None


def is_elementwise_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s class is one whose step on shards is exact (a wrapper's: that
    of the optimizer it wraps)."""
    inner = _wrapped(optimizer)
    if inner is not None:
        return is_elementwise_optimizer(inner)
    cls = _user_class(optimizer)
    package = cls.__module__.split(".")[0]
    return (
        cls in TORCH_ELEMENTWISE
        or cls in _declared
        or (package, cls.__name__) in _KNOWN_ELEMENTWISE
    )


def steps_shards_exactly(optimizer: torch.optim.Optimizer) -> bool:
    """Whether stepping shards with ``optimizer`` gives the whole parameters' step: it is
    element-wise, or declared shard-aware (a wrapper: the optimizer it wraps)."""
    inner = _wrapped(optimizer)
    if inner is not None:
        return steps_shards_exactly(inner)
    return is_elementwise_optimizer(optimizer) or _user_class(optimizer) in _shard_aware


def _steps_shards(group: ParameterGroup) -> bool:
    """Whether an optimizer of ``group``'s parameters sees pieces of them on some rank (the
    same answer on every rank: it reads the strategy and the topology only)."""
    if group.strategy == ShardingStrategy.NO_SHARD:
        return False
    return group.topology.shard_size > 1 or group.topology.shards_optimizer_across_outer


def refuse_sharded_non_elementwise(
    optimizer: torch.optim.Optimizer, within: Collection[ParameterGroup] | None = None
) -> None:
    """Raise if ``optimizer`` steps shards of parameters of ours (of ``within``'s groups
    only, when given) and is not known to be element-wise."""
    if steps_shards_exactly(optimizer):
        return
    allowed = None if within is None else {id(group) for group in within}
    sharded = [
        location.group.full_names[location.index]
        for group in optimizer.param_groups
        for param in group["params"]
        if (location := locate(param)) is not None
        and (allowed is None or id(location.group) in allowed)
        and _steps_shards(location.group)
    ]
    if not sharded:
        return
    cls = _user_class(optimizer)
    more = f" and {len(sharded) - 1} more" if len(sharded) > 1 else ""
    raise ValueError(
        f"optimizer: {cls.__module__}.{cls.__qualname__} would step each rank's shard of "
        f"sharded parameters ({sharded[0]!r}{more}), but {_why_refused(cls)}"
    )


def _why_refused(cls: type[torch.optim.Optimizer]) -> str:
    """The problem and the fixes, for a refused optimizer class."""
    why = _WHY_NOT.get(cls.__name__)
    unshard = (
        "shard nothing it steps (zero_dp_strategy=0; sharding_strategy=0 for "
        "mfsdp_hooks.fully_shard; data_parallel_sharding_strategy='no_shard' for "
        "Megatron-Core)"
    )
    elementwise = ", ".join(c.__name__ for c in TORCH_ELEMENTWISE)
    not_elementwise = (
        f"its update is not element-wise ({why}): on shards it computes something else than "
        "on whole parameters, and training would silently diverge."
    )
    if cls is torch.optim.Muon:
        return (
            f"{not_elementwise} Fix: use megatron_fsdp.Muon (mfsdp_hooks has it too): torch's "
            "arguments and state, exact on shards; handed to fully_shard(model, optimizer), "
            "fully_shard_optimizer or attach_optimizer, a torch.optim.Muon becomes it. "
            f"Or {unshard}"
        )
    if why is not None:
        return (
            f"{not_elementwise} An exact sharded {cls.__name__} is not supported yet: "
            f"{unshard}, or use an element-wise optimizer (torch's {elementwise})"
        )
    return (
        "nothing says its update is element-wise; one that reads whole tensors (as Muon, "
        "LBFGS and Adafactor do) computes something else on shards, and training silently "
        f"diverges. Either {unshard}, or use an element-wise optimizer (torch's "
        f"{elementwise}). If each element's update in {cls.__name__} reads only that "
        "element's weight, gradient and state, declare it once: "
        f"megatron_fsdp.declare_elementwise_optimizer({cls.__name__}) (mfsdp_hooks has it "
        "too); if its step gathers what it needs from the DTensor layout itself: "
        f"declare_shard_aware_optimizer({cls.__name__})"
    )
