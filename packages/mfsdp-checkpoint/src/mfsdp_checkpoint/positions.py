"""Which parameter each position of positional optimizer state belongs to.

torch numbers a writer's parameters across its ``param_groups``; the checkpoint keeps the
numbers, not the parameters, so the order is derived from the evidence: the two orders that
can be the writer's (this optimizer's, the model's) and the rules an order must fit are in the
package README ("Positional optimizer state"). Exactly one distinct order must fit, or the load
is refused naming the difference: a wrong pairing would resume silently with one parameter's
momentum on another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mfsdp_checkpoint.errors import StateDictMismatchError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class PositionEvidence:
    """What a checkpoint and the loading job tell about positional optimizer state."""

    our_groups: list[list[str]]
    """Our optimizer's parameter names, group by group, in its order."""
    writer_groups: list[list[Any]]
    """The positions of each of the writer's groups, as saved."""
    model_order: list[str]
    """The checkpoint's model names (translated to our naming) in the writer's order."""
    state_shapes: dict[int, list[Shape]]
    """The shapes of the saved non-scalar state tensors of each position."""
    param_shapes: dict[str, Shape]
    """The shape of each of our parameters, by our name."""


def _check_numbering(evidence: PositionEvidence) -> list[int]:
    ours = [len(group) for group in evidence.our_groups]
    theirs = [len(group) for group in evidence.writer_groups]
    if ours != theirs:
        raise StateDictMismatchError(
            "the checkpoint's optimizer state is keyed by position and its parameter groups "
            f"hold {theirs} parameters, this optimizer's {ours}: positions cannot be matched "
            "to parameters; build the optimizer over the parameters the writer's had"
        )
    numbers = [n for group in evidence.writer_groups for n in group]
    if numbers != list(range(len(numbers))):
        raise StateDictMismatchError(
            "the checkpoint's optimizer groups number their parameters "
            f"{numbers[:12]}{' ...' if len(numbers) > 12 else ''}, not 0, 1, 2, ... across "
            "the groups as torch's optimizer.state_dict() does; the order cannot be derived"
        )
    return theirs


def _misfit(order: list[str], evidence: PositionEvidence, sizes: list[int]) -> str | None:
    """Why ``order`` cannot be the writer's order, or None when it fits the evidence."""
    if len(order) != sum(sizes):
        return f"it names {len(order)} parameters, the checkpoint has {sum(sizes)} positions"
    start = 0
    for number, (size, ours) in enumerate(zip(sizes, evidence.our_groups, strict=True)):
        if set(order[start : start + size]) != set(ours):
            return f"it puts other parameters in group {number} than this optimizer has"
        start += size
    for position, name in enumerate(order):
        expected = evidence.param_shapes.get(name)
        for shape in evidence.state_shapes.get(position, []):
            if expected is not None and shape != expected:
                return (
                    f"position {position} would be {name} of shape {list(expected)}, but its "
                    f"saved state has shape {list(shape)}"
                )
    return None


def derive_positions(evidence: PositionEvidence) -> tuple[dict[str, int], str]:
    """Our parameter name -> the writer's position, and a sentence saying how it was derived."""
    sizes = _check_numbering(evidence)
    optimizer_order = [name for group in evidence.our_groups for name in group]
    wanted = set(optimizer_order)
    seen: set[str] = set()
    model_order = []
    for name in evidence.model_order:
        if name in wanted and name not in seen:
            seen.add(name)
            model_order.append(name)
    candidates = {"this optimizer's parameter order": optimizer_order}
    if model_order != optimizer_order:
        candidates["the model's parameter order (model.parameters())"] = model_order
    misfits = {label: _misfit(order, evidence, sizes) for label, order in candidates.items()}
    fitting = [label for label, why in misfits.items() if why is None]
    if not fitting:
        reasons = "; ".join(f"not {label}: {why}" for label, why in misfits.items())
        raise StateDictMismatchError(
            "the checkpoint's optimizer state is keyed by position and no parameter order "
            f"fits it ({reasons}); build the optimizer over the parameters the writer's had, "
            "in its order"
        )
    if len(fitting) > 1:
        first = next(
            i for i, (a, b) in enumerate(zip(optimizer_order, model_order, strict=True)) if a != b
        )
        raise StateDictMismatchError(
            "the checkpoint's optimizer state is keyed by position and fits two different "
            "parameter orders: this optimizer's and the model's (model.parameters()), which "
            f"differ first at position {first} ({optimizer_order[first]} vs "
            f"{model_order[first]}); which one the writer used cannot be told. Build the "
            "optimizer with its parameters in the writer's order (for NVIDIA megatron-fsdp: "
            "model.parameters())"
        )
    label = fitting[0]
    order = candidates[label]
    how = f"positions 0..{len(order) - 1} are {label}"
    if len(candidates) == 1:
        how += ", which is also the model's parameter order"
    how += "; group sizes and every saved state tensor's shape agree with it"
    return {name: position for position, name in enumerate(order)}, how
