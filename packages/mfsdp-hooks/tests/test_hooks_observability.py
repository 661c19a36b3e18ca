"""What a new user sees: a unit's repr, the wrap-time log (INFO, rank 0), the per-unit
forward/backward events (DEBUG), and wrap-time errors that say which rank built what.

The logs are captured inside each rank (a handler on the ``mfsdp_hooks`` logger) and sent
back as (logger, level, message) records.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch
from hooks_models import Block, make_batches, make_model, train_data_parallel, trainable
from torch import nn

from mfsdp_collectives import RankMismatchError
from mfsdp_collectives.testing import run_distributed, run_distributed_outcomes
from mfsdp_hooks import FSDPRootWrapper, ShardingOptions, fsdp_units
from mfsdp_hooks.runtime.unit import unit_of
from mfsdp_hooks.testing.parity import shard_blocks

BLOCK_NUMEL = 262  # LayerNorm(15) + Linear(15, 7) + Linear(7, 15)
EVENTS = ["pre_forward", "post_forward", "pre_backward", "post_backward"]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelname, record.getMessage()))


def _capture(level: int) -> _Records:
    handler = _Records()
    logger = logging.getLogger("mfsdp_hooks")
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler


# ----------------------------------------------------------------- repr
def _reprs(rank: int, world: int, strategy: int) -> dict[str, Any]:
    model = make_model()
    shard_blocks(model, sharding_strategy=strategy)
    before = repr(unit_of(model.blocks[0]))
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
    train_data_parallel(model, optimizer, make_batches(1), rank, world)
    unit = unit_of(model.blocks[0])
    assert unit is not None
    return {"before": before, "after": repr(unit), "units": [repr(u) for u in fsdp_units(model)]}


def _bytes(text: str) -> int:
    found = re.search(r"bytes_per_rank=(\d+)", text)
    assert found is not None, text
    return int(found.group(1))


def test_unit_repr_names_parameters_bytes_per_rank_and_state() -> None:
    zero3 = run_distributed(_reprs, 2, 3, timeout=120)[0]
    zero0 = run_distributed(_reprs, 2, 0, timeout=120)[0]
    # Before the first forward the unit is named by its class; after, by its path.
    assert re.fullmatch(
        r"FSDPUnit\(Block, params=6, groups=1, bytes_per_rank=\d+, "
        r"strategy=optim_grads_params, state=IDLE\)",
        zero3["before"],
    ), zero3["before"]
    assert zero3["after"].startswith("FSDPUnit(blocks.0 (Block), params=6, groups=1, ")
    assert zero3["after"].endswith(", strategy=optim_grads_params, state=IDLE)")
    assert zero3["units"][0].startswith("FSDPUnit(<root> (ToyModel), ")
    assert "object at 0x" not in " ".join(zero3["units"])
    # fp32 weights and gradients: unsharded each rank holds all of them, ZeRO-3 about half.
    assert _bytes(zero0["after"]) >= 2 * 4 * BLOCK_NUMEL, zero0["after"]
    assert _bytes(zero3["after"]) <= 0.6 * _bytes(zero0["after"]), (zero3, zero0)
    assert _bytes(zero3["after"]) >= 2 * 4 * BLOCK_NUMEL // 2, zero3["after"]


# ----------------------------------------------------------------- logging
def _logged(rank: int, world: int, level: int) -> list[tuple[str, str, str]]:
    handler = _capture(level)
    options = ShardingOptions(sync_model_each_microbatch=False)
    model = FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options)
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
    train_data_parallel(model, optimizer, make_batches(1), rank, world)
    return handler.records


def test_wrap_time_summary_on_rank_zero_at_info() -> None:
    records = run_distributed(_logged, 2, logging.INFO, timeout=120)
    assert records[1] == [], records[1]  # rank 0 speaks for all
    lines = [message for name, level, message in records[0] if level == "INFO"]
    assert all(name == "mfsdp_hooks.observe" for name, _, _ in records[0]), records[0]
    assert len(lines) == 5, lines  # root, 3 blocks, total
    assert lines[0].startswith("FSDP unit <root> (ToyModel): "), lines[0]
    for index in range(3):
        line = lines[1 + index]
        assert line.startswith(f"FSDP unit blocks.{index} (Block): 1 group(s) "), line
        assert f"[6 params float32, {BLOCK_NUMEL} elements over dp_shard(2)]" in line, line
        assert "optim_grads_params, per rank " in line and " weights + " in line, line
    # The root holds the tied embedding/head, the frozen layer and the output: 2 groups.
    assert "2 group(s)" in lines[0] and "params frozen float32" in lines[0], lines[0]
    assert re.fullmatch(r"FSDP model ToyModel: 4 unit\(s\), [\d.]+ KiB per rank", lines[4])
    assert not any(level == "DEBUG" for _, level, _ in records[0])


def test_per_unit_forward_backward_events_at_debug() -> None:
    records = run_distributed(_logged, 2, logging.DEBUG, timeout=120)
    for rank_records in records:
        events: dict[str, list[str]] = {}
        for name, level, message in rank_records:
            if level == "DEBUG":
                assert name == "mfsdp_hooks.observe", name
                unit, event = message.rsplit(": ", 1)
                events.setdefault(unit, []).append(event)
        expected = ["<root> (ToyModel)"] + [f"blocks.{i} (Block)" for i in range(3)]
        assert sorted(events) == sorted(expected), events
        for unit, seen in events.items():
            assert seen == EVENTS, (unit, seen)


# ----------------------------------------------------------------- wrap-time mismatches
def _mismatched(rank: int, world: int, what: str) -> None:
    odd = rank == world - 1
    model = make_model(n_blocks=3)
    if what == "deeper" and odd:  # one block fewer: its last two blocks pair with rank 0's
        del model.blocks[0]
    if what == "shape" and odd:
        model.blocks[1].fc2 = nn.Linear(8, 15)  # fc2.weight (15, 8) instead of (15, 7)
    if what == "dtype" and odd:
        model.blocks[2].norm.to(torch.float64)
    FSDPRootWrapper(model, fsdp_unit_modules=[Block])


def _messages(what: str, world: int) -> list[str]:
    outcomes = run_distributed_outcomes(_mismatched, world, what, timeout=120)
    messages = []
    for outcome in outcomes:
        assert outcome.error is not None, f"rank {outcome.rank} wrapped a mismatched model"
        assert isinstance(outcome.error.exception, RankMismatchError), outcome.error
        messages.append(str(outcome.error.exception))
    assert len(set(messages)) == 1, messages  # every rank says the same
    return messages


@pytest.mark.parametrize(
    ("what", "words"),
    [
        (
            "shape",
            [
                "first difference in parameters, item 4: rank 0: fc2.weight (15, 7) float32; "
                "rank 1: fc2.weight (15, 8) float32",
                "\nrank 1 differs from rank 0",
            ],
        ),
        (
            "dtype",
            [
                "first difference in parameters, item 0: rank 0: norm.weight (15,) float32; "
                "rank 1: norm.weight (15,) float64",
                "\nrank 1 differs from rank 0",
            ],
        ),
        (
            "deeper",
            [
                "units_inside: rank 0: 0; rank 1: 2 (2 Block)",
                "The ranks' models have different numbers of units, so the modules compared "
                "above are not the same module: rank 1 wraps ToyModel around the 2 unit(s) "
                "wrapped before, while rank 0 wraps another Block: rank 0 has more units",
            ],
        ),
    ],
)
def test_mismatch_names_the_rank_and_what_differs(what: str, words: list[str]) -> None:
    message = _messages(what, 2)[0]
    for word in words:
        assert word in message, message
    if what != "deeper":
        assert "different numbers of units" not in message, message


def test_one_odd_rank_out_of_three_is_named() -> None:
    message = _messages("shape", 3)[0]
    assert "\nrank 2 differs from ranks 0, 1\n" in message, message
    assert "ranks 0, 1: fc2.weight (15, 7) float32; rank 2: fc2.weight (15, 8) float32" in (
        message
    ), message
