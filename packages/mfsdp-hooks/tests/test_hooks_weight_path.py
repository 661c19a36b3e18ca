"""``weight_path``: the decision ``ParameterGroup.unshard``/``install_weights`` follow.

The decision replaced two nested ladders; the reference below is those ladders written out
as they were, and every combination of the inputs must land on the same steps.
"""

from __future__ import annotations

import itertools

import pytest

from mfsdp_hooks.weights.weight_freshness import WeightFreshness, WeightPath, weight_path

P = WeightPath


def _ladders(sharded: bool, gathered: bool, stale: bool, unsharding: bool, whole: bool) -> P:
    """The steps the former ``unshard`` (``unsharding``) and ``install_weights`` took."""
    if not unsharding:  # install_weights: always rebuilds
        if sharded:
            return P.REFRESH_AND_GATHER if gathered else P.REFRESH
        return P.ENCODE_WHOLE if whole else P.ENCODE_AND_GATHER
    if sharded:
        if gathered and not stale:
            return P.CURRENT
        return P.REFRESH_AND_GATHER if stale else P.GATHER
    if stale:
        return _ladders(sharded, gathered, True, False, whole)
    return P.CURRENT


@pytest.mark.parametrize(
    ("sharded", "gathered", "stale", "whole"), list(itertools.product((0, 1), repeat=4))
)
def test_the_decision_takes_the_steps_the_ladders_took(
    sharded: int, gathered: int, stale: int, whole: int
) -> None:
    flags = {"sharded": bool(sharded), "gathered": bool(gathered), "whole_main": bool(whole)}
    unshard = weight_path(stale=bool(stale), unsharding=True, **flags)
    assert unshard is _ladders(bool(sharded), bool(gathered), bool(stale), True, bool(whole))
    install = weight_path(stale=True, unsharding=False, **flags)
    assert install is _ladders(bool(sharded), bool(gathered), True, False, bool(whole))


def test_freshness_transitions() -> None:
    fresh = WeightFreshness(steppable=True)
    assert not fresh.dirty and not fresh.step_window_open
    fresh.open_step_window()
    fresh.recheck_step_window()
    assert fresh.dirty and fresh.step_window_open
    fresh.installed()
    assert not fresh.dirty
    fresh.close_step_window(stepped=False)
    fresh.recheck_step_window()
    assert not fresh.dirty and not fresh.step_window_open
    fresh.attach_stepper()
    fresh.open_step_window()
    assert not fresh.step_window_open
    fresh.close_step_window(stepped=True)
    assert fresh.dirty
    with pytest.raises(AttributeError):
        fresh.dirty = False  # type: ignore[misc]
