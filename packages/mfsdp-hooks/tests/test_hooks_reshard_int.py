"""FSDP2's ``reshard_after_forward=<int>``: after forward the weights stay sharded over that
many consecutive ranks, so backward gathers among them only. Side by side with FSDP2 on 4 CPU
ranks with ``reshard_after_forward=2``: no backward all-gather on the 4-rank group, the same
losses as ``True`` (bitwise), half the unsharded weights held from forward to backward, the
none of it left after backward (no step peaks above the first two), and the same calls and
bytes as FSDP2 in each phase. A custom all-gather (``set_custom_all_gather``) runs the backward
gathers over the pairs as FSDP2's does; block-quantized weights gather the pairs' slices
exactly (backward computes with the forward's weights, bitwise as ``True``)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hooks_models import AlignedModel
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from mfsdp_buffers import LiveTensorTracker
from mfsdp_collectives import BlockQuantization, C10dTracer, CommLog, CommTracer
from mfsdp_collectives.testing import run_distributed
from mfsdp_collectives.testing.counting_comms import CountingAllGather
from mfsdp_hooks.testing.parity import shard_blocks

STEPS = 4
WORLD = 4


def _shard(model: nn.Module, impl: str, reshard: bool | int) -> None:
    """``impl``: ``"fsdp2"``, ``"ours"`` or ``"ours_in_order"`` (no prefetch, no reduction in
    flight: every step's peak is then the same to the byte, not subject to thread timing)."""
    options: dict[str, Any] = {"reshard_after_forward": reshard}
    if impl == "ours_in_order":
        options.update(overlap_param_gather=False, overlap_grad_reduce=False)
    shard_blocks(model, "fsdp2" if impl == "fsdp2" else "ours", **options)


def _phase(log: CommLog) -> dict[str, dict[str, int]]:
    return {k: v for k, v in log.summary().items() if "/all_gather" in k}


def _worker(rank: int, world: int, impl: str, reshard: bool | int) -> dict[str, Any]:
    from mfsdp_hooks import fsdp_units

    tracer: Any = C10dTracer if impl == "fsdp2" else CommTracer
    out: dict[str, Any] = {"losses": [], "forward": [], "backward": [], "peaks": [], "held": []}
    out["held_after_backward"] = []
    with LiveTensorTracker() as memory:
        model = AlignedModel()
        _shard(model, impl, reshard)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 32, generator=generator), torch.randn(8, 16, generator=generator)
            memory.mark("between steps")
            with tracer() as forward:
                loss = nn.functional.mse_loss(
                    model(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2]
                )
            if impl != "fsdp2":
                groups = [g for unit in fsdp_units(model) for g in unit.groups]
                out["held"].append(
                    (
                        sum(g.post_forward_numel for g in groups),
                        sum(g.layout.padded_numel for g in groups),
                    )
                )
            with tracer() as backward:
                loss.backward()
            if impl != "fsdp2":
                out["held_after_backward"].append(sum(g.post_forward_numel for g in groups))
            optimizer.step()
            optimizer.zero_grad()
            out["peaks"].append(memory.mark(f"step {step}").peak)
            out["losses"].append(loss.item())
            out["forward"].append(_phase(forward))
            out["backward"].append(_phase(backward))
    return out


FULL = os.environ.get("MFSDP_FULL_MATRIX") == "1"
_FULL_ONLY = pytest.mark.skipif(not FULL, reason="MFSDP_FULL_MATRIX=1 only")
Runs = dict[tuple[str, bool | int], list[dict[str, Any]]]


@pytest.fixture(scope="module")
def runs() -> Runs:
    """CI: ours and FSDP2 with pairs; MFSDP_FULL_MATRIX=1 also ours with a full reshard and
    ours in order (no prefetch, no reduction in flight)."""
    keys: list[tuple[str, bool | int]] = [("ours", 2), ("fsdp2", 2)]
    if FULL:
        keys += [("ours", True), ("ours_in_order", 2)]
    return {
        (impl, reshard): run_distributed(_worker, WORLD, impl, reshard, timeout=180)
        for impl, reshard in keys
    }


def test_backward_gathers_stay_inside_pairs_and_losses_match_a_full_reshard(runs: Runs) -> None:
    for rank, pairs in enumerate(runs["ours", 2]):
        pair = "post_forward[0,1]" if rank < 2 else "post_forward[2,3]"
        for step, backward in enumerate(pairs["backward"]):
            assert list(backward) == [f"{pair}/all_gather"], (step, backward)
            assert backward[f"{pair}/all_gather"]["calls"] == 4
    if not FULL:
        return
    for full, pairs in zip(runs["ours", True], runs["ours", 2], strict=True):
        assert pairs["losses"] == full["losses"]  # bitwise
        assert pairs["forward"] == full["forward"]
        for step, backward in enumerate(pairs["backward"]):
            full_bytes = sum(v["bytes"] for v in full["backward"][step].values())
            assert sum(v["bytes"] for v in backward.values()) == 2 * full_bytes


def test_half_the_weights_are_held_from_forward_to_backward_and_every_step_peaks_the_same(
    runs: Runs,
) -> None:
    for result in runs["ours", 2] + runs.get(("ours_in_order", 2), []):
        for held, padded in result["held"]:
            assert held * 2 == padded
        assert result["held_after_backward"] == [0] * STEPS
    # With prefetching and reductions in flight the CPU peaks vary with thread timing; in
    # order, each step's peak is exact: the slices held after forward never pile up.
    for result in runs.get(("ours_in_order", 2), []):
        first = result["peaks"][0]
        assert all(abs(peak - first) <= 0.01 * first for peak in result["peaks"]), result["peaks"]


def test_calls_and_bytes_per_phase_match_fsdp2(runs: Runs) -> None:
    for ours, fsdp2 in zip(runs["ours", 2], runs["fsdp2", 2], strict=True):
        for phase in ("forward", "backward"):
            for mine, theirs in zip(ours[phase], fsdp2[phase], strict=True):
                calls = sum(v["calls"] for v in mine.values())
                assert calls == theirs["c10d/all_gather"]["calls"], (phase, mine, theirs)
                assert sum(v["bytes"] for v in mine.values()) == theirs["c10d/all_gather"]["bytes"]
        for a, b in zip(ours["losses"], fsdp2["losses"], strict=True):
            assert abs(a - b) <= 1e-6 * abs(b)


def _step_recording_backward_gathers(
    loss: torch.Tensor, optimizer: torch.optim.Optimizer, out: dict[str, Any]
) -> None:
    """Backward (recording which groups it all-gathers over), step, and the loss."""
    with CommTracer() as backward:
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    out["losses"].append(loss.item())
    out["backward"].append(sorted(k for k in backward.summary() if "/all_gather" in k))


def _variant_worker(rank: int, world: int, variant: str, reshard: bool | int) -> dict[str, Any]:
    """The toy model (tied embedding, frozen layer) trained with ``reshard`` and a twist."""
    from hooks_models import local_slice, loss_fn, make_batches, make_model

    from mfsdp_hooks import MixedPrecisionPolicy, fsdp_units

    model = make_model(checkpoint="non_reentrant" if variant == "recompute" else None)
    options: dict[str, Any] = {"reshard_after_forward": reshard}
    if variant == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    shard_blocks(model, **options)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    groups = [g for unit in fsdp_units(model) for g in unit.groups]
    out: dict[str, Any] = {"losses": [], "backward": [], "held_after_eval": []}
    for step, (tokens, targets) in enumerate(make_batches(STEPS)):
        tokens, targets = local_slice(tokens, rank, world), local_slice(targets, rank, world)
        if variant == "eval":
            with torch.no_grad():
                model(tokens)
            out["held_after_eval"].append(sum(g.post_forward_numel for g in groups))
        if variant == "set_true" and step == 2:
            model.set_reshard_after_forward(True)
        loss = loss_fn(model(tokens), targets)
        _step_recording_backward_gathers(loss, optimizer, out)
    return out


@pytest.mark.parametrize(
    "variant",
    [pytest.param(v, marks=_FULL_ONLY) for v in ("set_true", "recompute", "bf16", "eval")],
)
def test_int_reshard_with_recompute_mixed_precision_eval_and_the_setter(variant: str) -> None:
    full = run_distributed(_variant_worker, WORLD, variant, True, timeout=180)
    pairs = run_distributed(_variant_worker, WORLD, variant, 2, timeout=180)
    for rank, (a, b) in enumerate(zip(full, pairs, strict=True)):
        assert a["losses"] == b["losses"], variant  # bitwise
        pair = "post_forward[0,1]" if rank < 2 else "post_forward[2,3]"
        for step, gathered in enumerate(b["backward"]):
            expected = "dp_shard" if variant == "set_true" and step >= 2 else pair
            assert gathered == [f"{expected}/all_gather"], (variant, step, gathered)
        assert b["held_after_eval"] == [0] * (STEPS if variant == "eval" else 0)


def _refusal_worker(rank: int, world: int, value: Any, strategy: int) -> str:
    from mfsdp_hooks import fully_shard

    try:
        fully_shard(AlignedModel(), reshard_after_forward=value, sharding_strategy=strategy)
    except ValueError as error:
        return str(error)  # raised on every rank before anything was communicated
    return "no error"


@pytest.mark.parametrize(
    ("value", "strategy", "message"),
    [
        (3, 3, "reshard_after_forward=3 must be a divisor of the shard group's size (4)"),
        pytest.param(0, 3, "reshard_after_forward=0 must be a divisor", marks=_FULL_ONLY),
        pytest.param(2, 2, "reshard_after_forward=2 with sharding_strategy=2", marks=_FULL_ONLY),
    ],
)
def test_int_reshard_that_cannot_be_honoured_is_refused_on_every_rank(
    value: Any, strategy: int, message: str
) -> None:
    for answer in run_distributed(_refusal_worker, WORLD, value, strategy, timeout=60):
        assert message in answer, answer


def _hsdp_worker(rank: int, world: int, reshard: bool | int) -> dict[str, Any]:
    """HSDP on a (dp_outer=2, dp_shard=4) mesh: pairs inside each replica's shard group."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_outer", "dp_shard"))
    model = AlignedModel()
    shard_blocks(model, mesh=mesh, reshard_after_forward=reshard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict[str, Any] = {"losses": [], "backward": []}
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 32, generator=generator), torch.randn(16, 16, generator=generator)
        rows = slice(2 * rank, 2 * rank + 2)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        _step_recording_backward_gathers(loss, optimizer, out)
    return out


@_FULL_ONLY  # 8 ranks
def test_int_reshard_under_hsdp_keeps_backward_gathers_inside_each_replica_pair() -> None:
    full = run_distributed(_hsdp_worker, 8, True, timeout=300)
    pairs = run_distributed(_hsdp_worker, 8, 2, timeout=300)
    for rank, (a, b) in enumerate(zip(full, pairs, strict=True)):
        assert a["losses"] == b["losses"]
        first = rank // 2 * 2
        assert b["backward"] == [[f"post_forward[{first},{first + 1}]/all_gather"]] * STEPS


def _custom_gather_worker(
    rank: int, world: int, impl: str, reshard: bool | int, quantized: bool
) -> dict[str, Any]:
    """Every unit's all-gathers through a custom comm: a counted one (ours or FSDP2), or
    ``quantize_communication``'s int8 weights (ours; the gradients stay fp32)."""
    from mfsdp_hooks import quantize_communication

    model = AlignedModel()
    _shard(model, impl, reshard)
    comms = []
    if quantized:  # blocks that do not divide the 1024-value shards
        quantize_communication(model, gradients=None, weights=BlockQuantization(bits=8, block=96))
    else:
        for unit in model.modules():
            if isinstance(unit, TorchFSDPModule):
                comms.append(CountingAllGather())
                unit.set_custom_all_gather(comms[-1])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"losses": [], "forward": [], "backward": [], "traced": [], "sizes": []}
    seen = [0] * len(comms)

    def sizes_since_last() -> list[int]:
        """The group sizes the comms gathered over since the last call."""
        new = [size for i, comm in enumerate(comms) for size in comm.group_sizes[seen[i] :]]
        seen[:] = [len(comm.group_sizes) for comm in comms]
        return sorted(new)

    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 32, generator=generator), torch.randn(8, 16, generator=generator)
        with C10dTracer() as forward:
            rows = slice(2 * rank, 2 * rank + 2)
            loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        in_forward = sizes_since_last()
        with C10dTracer() as backward, CommTracer() as traced:
            loss.backward()
        out["sizes"].append((in_forward, sizes_since_last()))
        out["forward"].append(forward.summary())
        out["backward"].append(backward.summary())
        out["traced"].append(sorted(k for k in traced.summary() if "/all_gather" in k))
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(loss.item())
    return out


def test_a_custom_all_gather_runs_the_backward_gathers_over_the_pairs_as_fsdp2() -> None:
    ours = run_distributed(_custom_gather_worker, WORLD, "ours", 2, False, timeout=180)
    fsdp2 = run_distributed(_custom_gather_worker, WORLD, "fsdp2", 2, False, timeout=180)
    for mine, theirs in zip(ours, fsdp2, strict=True):
        # each of the 4 units' comm: its forward gather over the 4 ranks, its backward one
        # over this rank's pair, as FSDP2's
        assert mine["sizes"] == theirs["sizes"]
        assert mine["sizes"] == [([4, 4, 4, 4], [2, 2, 2, 2])] * STEPS, mine["sizes"]
        for phase in ("forward", "backward"):  # all-gather calls and bytes on the wire
            for got, want in zip(mine[phase], theirs[phase], strict=True):
                assert got["c10d/all_gather"] == want["c10d/all_gather"], phase
        for a, b in zip(mine["losses"], theirs["losses"], strict=True):
            assert abs(a - b) <= 1e-6 * abs(b)


def test_quantized_weights_regather_the_pairs_slices_exactly() -> None:
    full = run_distributed(_custom_gather_worker, WORLD, "ours", True, True, timeout=180)
    pairs = run_distributed(_custom_gather_worker, WORLD, "ours", 2, True, timeout=180)
    for rank, (a, b) in enumerate(zip(full, pairs, strict=True)):
        assert a["losses"] == b["losses"]  # bitwise: backward used the forward's weights
        pair = "post_forward[0,1]" if rank < 2 else "post_forward[2,3]"
        for step, traced in enumerate(b["traced"]):
            assert f"{pair}/all_gather" in traced, (step, traced)
            assert not any("dp_shard" in name for name in traced), (step, traced)
