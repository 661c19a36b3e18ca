"""Resume from checkpoints written by NVIDIA megatron-fsdp 0.6.1 (its README's DCP snippet:
``module.*`` model names, optimizer state keyed by position), committed under
tests/data/megatron_fsdp_0_6_1 with the script that made them.

Each resume, under the seed API and the per-module API, on 2 and 3 ranks, with SGD+momentum
and AdamW, must continue the one-process loss curve of ``reference_fixture`` (<= 1e-5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import reference_fixture as rf
import torch
from torch import nn

import megatron_fsdp
import mfsdp_checkpoint as mc
import mfsdp_hooks
from mfsdp_collectives.testing import run_distributed

FIXTURE = Path(__file__).parent / "data" / "megatron_fsdp_0_6_1"


def _shard(api: str, strategy: int, kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = rf.make_model(seed=123)  # another init: everything must come from the checkpoint
    if api == "seed":
        optimizer = rf.make_optimizer(model.parameters(), kind)
        sharded, optimizer = megatron_fsdp.fully_shard(
            model, optimizer, fsdp_unit_modules=[rf.Block], zero_dp_strategy=strategy
        )
        return sharded, optimizer
    for block in model.blocks:
        mfsdp_hooks.fully_shard(block, sharding_strategy=strategy)
    sharded = mfsdp_hooks.fully_shard(model, sharding_strategy=strategy)
    return sharded, rf.make_optimizer(sharded.parameters(), kind)


def _resume(rank: int, world: int, api: str, strategy: int, kind: str) -> list[float]:
    model, optimizer = _shard(api, strategy, kind)
    mc.load_checkpoint(FIXTURE / kind, model, optimizer)
    return rf.train_steps(model, optimizer, range(rf.SAVE_AT + 1, rf.TOTAL + 1), rank, world)


def test_the_fixture_is_what_its_writer_says() -> None:
    """The committed run matches one-process training, and its optimizer held the model's
    parameters in model order (what the loader derives, here checked against the writer)."""
    written = json.loads((FIXTURE / "writer.json").read_text())
    names = [n for n, _ in rf.make_model().named_parameters()]
    for kind in rf.KINDS:
        record = written["kinds"][kind]
        assert record["optimizer_param_order"] == [f"module.{n}" for n in names]
        expected = rf.one_process_losses(kind, rf.SAVE_AT)
        for got, want in zip(record["losses"], expected, strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (record["losses"], expected)
    report = mc.describe(FIXTURE / "sgd")
    assert report["writer"].startswith("NVIDIA megatron-fsdp"), report["writer"]
    assert report["naming"] == {"model_prefix": "module.", "optimizer_state": "by-position"}


@pytest.mark.parametrize("kind", rf.KINDS)
@pytest.mark.parametrize(
    ("api", "world", "strategy"),
    [("seed", 2, 3), ("seed", 3, 3), ("seed", 3, 1), ("per_module", 2, 3), ("per_module", 3, 2)],
)
def test_resume_from_nvidia_megatron_fsdp_continues_the_curve(
    api: str, world: int, strategy: int, kind: str
) -> None:
    resumed = run_distributed(_resume, world, api, strategy, kind, timeout=180)[0]
    expected = rf.one_process_losses(kind, rf.TOTAL)[rf.SAVE_AT :]
    for step, (got, want) in enumerate(zip(resumed, expected, strict=True), rf.SAVE_AT + 1):
        assert abs(got - want) <= 1e-5 * abs(want), (api, world, kind, step, resumed, expected)
