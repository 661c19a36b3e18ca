"""Host offload with the tools users bring: peft's LoRA, ``torch.compile`` per block, and
torch's state-dict helpers and plain DCP (``ecosystem_cases``), through the per-module
``fully_shard(offload_policy=CPUOffloadPolicy())`` and the seed one-liner
``megatron_fsdp.fully_shard(model, optimizer, optimizer_cpu_offload=True)``.

On CPU with the host copies forced (``mfsdp_hooks.testing.offload``): each cell trains 10
AdamW steps on 2 ranks and matches one process on the global batch (every step's loss and
the final full weights within 1e-5); the round trips save after 5 steps, load into a fresh
offloaded model and optimizer drawn from another seed, and train the other 5.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import ecosystem_cases
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

import megatron_fsdp
import mfsdp_hooks
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing import Block, make_model
from mfsdp_hooks.testing.offload import forced_host_copies, offload_counts, offloads
from mfsdp_hooks.testing.parity import ParityCase, adamw, check_parity, trainable
from mfsdp_hooks.testing.plain_dcp import DCPBlock, check_plain_dcp_resume

ENTRIES = ("per_module", "seed")
Pair = tuple[nn.Module, Optimizer]


def _model(cell: str, seed: int) -> nn.Module:
    return ecosystem_cases.model("lora", seed) if cell == "lora" else make_model(seed)


def _wrap(
    entry: str, model: nn.Module, optimizer: Optimizer | None = None, unit: type[nn.Module] = Block
) -> Pair:
    """``model`` offloaded through ``entry`` (its ``unit`` blocks one unit each) and the AdamW
    that steps it: ``optimizer``, built on the original parameters (or a new one), handed to
    the seed one-liner; per module, one built on the sharded model, as FSDP2 users do."""
    with forced_host_copies():
        if entry == "seed":
            optimizer = optimizer or adamw(trainable(model))
            wrapped, optimizer = megatron_fsdp.fully_shard(
                model, optimizer, fsdp_unit_modules=[unit], optimizer_cpu_offload=True
            )
        else:
            policy = CPUOffloadPolicy(pin_memory=True)
            for block in [m for m in model.modules() if isinstance(m, unit)]:
                mfsdp_hooks.fully_shard(block, offload_policy=policy)
            wrapped = mfsdp_hooks.fully_shard(model, offload_policy=policy)
            optimizer = adamw(trainable(wrapped))
    assert len(offloads(wrapped)) == len(mfsdp_hooks.fsdp_units(wrapped)) > 1, "not offloaded"
    return wrapped, optimizer


@dataclass
class _Run:
    """A cell through an entry point, as the parity case's ``wrap`` and ``resume``: the pair
    that trains last (a round trip's fresh one) and the graphs ``compile_block`` compiled."""

    entry: str
    cell: str
    ckpt: str
    pair: Pair | None = None
    counter: ecosystem_cases.GraphCounter | None = None

    def wrap(self, model: nn.Module, optimizer: Optimizer | None = None) -> Pair:
        self.pair = _wrap(self.entry, model, optimizer)
        _, self.counter = ecosystem_cases.compiled(self.cell, self.pair[0], Block)  # in place
        return self.pair

    def resume(self, model: nn.Module, optimizer: Optimizer, step: int) -> Pair:
        """The state taken out after ``step`` steps and put into a fresh pair."""
        load = ecosystem_cases.round_trip(self.cell, model, optimizer, f"{self.ckpt}-{step}")
        fresh = self.wrap(_model(self.cell, 123))  # another seed: the load must win
        load(*fresh)
        return fresh


def _assert_steps_the_host_shards(
    model: nn.Module, optimizer: Optimizer, what: str, *, lora: bool
) -> None:
    """Every group offloaded, the optimizer stepping its host shards (after a load too), and
    its reduced gradients copied home; with LoRA, each block's unit holds a frozen group
    beside a trainable one."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for unit in mfsdp_hooks.fsdp_units(model):
        for group in unit.groups:
            assert group.offload is not None and group.main is not None, what
            host = group.main.shard.untyped_storage().data_ptr()
            for param in group.dist_params:
                assert isinstance(param, DTensor), what
                assert param.to_local().untyped_storage().data_ptr() == host, what
                assert (id(param) in stepped) == group.requires_grad, what
    if lora:
        blocks = mfsdp_hooks.fsdp_units(model)[1:]
        assert all({g.requires_grad for g in u.groups} == {True, False} for u in blocks), what
    assert offload_counts(model).to_host > 0, f"{what}: no gradient came home"


def _worker(rank: int, world: int, cells: list[str], ckpt: str) -> int:
    """Each cell through each entry point against one process (``check_parity``: 10 steps,
    the round trips after 5); then, for the round trips, plain DCP of
    ``optimizer.state_dict()`` (``check_plain_dcp_resume``). Returns the most empty local
    pieces a plain-DCP model had on this rank."""
    for cell in cells:
        for entry in ENTRIES:
            what, run = f"{entry} x {cell}", _Run(entry, cell, f"{ckpt}/{entry}-{cell}")
            resume = run.resume if cell in ecosystem_cases.ROUND_TRIPS else None
            model = functools.partial(_model, cell, 0)
            check_parity(rank, world, ParityCase(what, model=model, wrap=run.wrap, resume=resume))
            assert run.counter is None or run.counter.graphs > 0, f"{what}: compiled nothing"
            assert run.pair is not None, what
            _assert_steps_the_host_shards(*run.pair, what, lora=cell == "lora")
    if "dcp_plain" not in cells:
        return 0
    # FSDP2's script: dcp.save/load of model.state_dict() and optimizer.state_dict(), the
    # model resumed by dcp.load alone (in place, into the host shards) or by load_state_dict
    # after it; the units split mid-parameter (an empty piece on one rank).
    empties = []
    for entry, then_load in (("per_module", False), ("seed", True)):
        empties.append(
            check_plain_dcp_resume(
                rank,
                world,
                f"{ckpt}/plain-{entry}",
                functools.partial(_wrap, entry, unit=DCPBlock),
                model_load_state_dict=then_load,
                init_state=entry != "seed",  # the seed's enable_dcp gives placeholders
            )
        )
    return max(empties)


def test_offload_with_lora_and_compiled_blocks_trains_as_one_process(tmp_path: Path) -> None:
    run_distributed(_worker, 2, ["lora", "compile_block"], str(tmp_path), timeout=240)


def test_offload_round_trips_through_torch_state_dicts_and_plain_dcp(tmp_path: Path) -> None:
    cells = list(ecosystem_cases.ROUND_TRIPS)
    empties = run_distributed(_worker, 2, cells, str(tmp_path), timeout=240)
    assert max(empties) > 0, "no rank held an empty piece: the uneven split is not covered"
