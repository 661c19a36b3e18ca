"""The cells of the entry-point x feature matrix (``test_megatron_fsdp_matrix.py``).

A cell is (row, column): an entry point and a feature. ``cell_worker`` runs on every rank:
it builds the column's model and meshes, wraps them through the row's entry point, trains
``STEPS`` steps and returns the global loss of each step and the final full weights, or the
exception the wrap raised. ``reference_run`` trains the same model in one process on the
same global batches: the ground truth the test compares with.

Rows (entry points):

* ``seed``: ``megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[...], ...)``.
* ``model_optimizer``: ``fully_shard_model`` then ``fully_shard_optimizer``.
* ``class``: ``megatron_fsdp.MegatronFSDP(module, FSDPDistributedIndex(...),
  DistributedDataParallelConfig(...), fsdp_unit_modules=[...])``.
* ``per_module``: ``mfsdp_hooks.fully_shard`` on each block, then the root; a plain optimizer
  built afterwards on ``model.parameters()``.
* ``mcore``: ``megatron_fsdp.mcore.FullyShardedDataParallel`` with stand-ins for
  Megatron-Core's configs, driven as Megatron-Core's loop drives a model chunk
  (``zero_grad_buffer``, backward, ``finish_grad_sync``, ``scale_gradients``, a plain
  optimizer step, ``copy_main_weights_to_model_weights``, ``start_param_sync``).

Model families: ``toy`` (``mfsdp_hooks.testing.ToyModel``: tied embedding and head, a frozen
layer), ``tp`` (``mfsdp_hooks.testing.tp``), ``ep`` (``mfsdp_hooks.testing.moe``) and
``float8`` (``mfsdp_te.float8_testing``). Every toy cell carries the tie and the frozen layer;
the ``tied`` and ``frozen`` columns also assert them explicitly.

The pieces live beside this module: ``matrix_columns`` (rows, columns, their data),
``matrix_layouts`` (meshes and each rank's share), ``matrix_builds`` (the entry points),
``matrix_training`` (the step, and the one-process reference) and ``mcore_stand_ins``
(Megatron-Core's configs). This module runs a cell and re-exports what the tests import.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ecosystem_cases
import torch
import torch.distributed as dist
from matrix_builds import Built, build, torch_sd_model
from matrix_columns import COLS, ROWS, SAVE_AFTER, STEPS, unit_class, world_size
from matrix_layouts import local_share, make_layout
from matrix_training import assert_parity, eval_loss, final_weights, reference_run, train_step

import mfsdp_hooks
from mfsdp_checkpoint import load_checkpoint, save_checkpoint
from mfsdp_collectives.testing.counting_comms import (
    CountingAllGather,
    CountingReduceScatter,
    GradientRecorder,
)

__all__ = [
    "COLS",
    "ROWS",
    "STEPS",
    "assert_parity",
    "build",
    "cell_worker",
    "final_weights",
    "local_share",
    "make_layout",
    "reference_run",
    "train_step",
    "world_size",
]


def _check_post_forward_groups(built: Built, col: str) -> None:
    """reshard_int: the option reached every unit, as pairs of consecutive ranks."""
    if col != "reshard_int":
        return
    units = mfsdp_hooks.fsdp_units(built.inner)
    assert units and all(u.options.post_forward is not None for u in units), "not honoured"
    assert {u.options.post_forward.size for u in units if u.options.post_forward} == {2}


def _install_comm_hooks(built: Built) -> list[tuple[Any, ...]]:
    """comm_hooks: FSDP2's custom all-gather and reduce-scatter (exact, counted) and an
    all-reduce hook on every unit the entry point made; per unit, its comms and how many
    gradient reductions a step makes."""
    installed = []
    for module in built.model.modules():
        if not isinstance(module, mfsdp_hooks.FSDPModule):
            continue
        gather, scatter, hook = CountingAllGather(), CountingReduceScatter(), GradientRecorder()
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(scatter)
        module.set_all_reduce_hook(hook)
        unit = mfsdp_hooks.fsdp_units(module)[0]  # its own unit comes first
        installed.append((gather, scatter, hook, sum(g.reducer is not None for g in unit.groups)))
    return installed


def _check_comm_hooks(installed: list[tuple[Any, ...]]) -> None:
    """Every unit gathered through its comm and reduced through its comm once per step,
    the hook seeing each reduction."""
    if not installed:
        return
    for gather, scatter, hook, reductions in installed:
        assert gather.calls > 0 and len(gather.allocated) == gather.calls, "gathers bypassed"
        assert scatter.calls == len(hook.sums) == STEPS * reductions, "reductions bypassed"


def _check_tied_and_frozen(built: Built, col: str, trained: bool) -> None:
    inner = built.inner
    if col == "tied":
        assert inner.head.weight is inner.embed.weight, "the tie was lost by wrapping"
        names = [n for n, _ in built.model.named_parameters()]
        assert not any(n.endswith("head.weight") for n in names), names  # one parameter
    if col == "frozen":
        weight = inner.frozen.weight
        assert not weight.requires_grad, "the frozen layer became trainable"
        if trained:
            assert weight.grad is None, "the frozen layer got a gradient"


def cell_worker(rank: int, world: int, row: str, col: str, ckpt: str) -> dict[str, Any]:
    """One cell on one rank: the refusal, or losses, eval losses and final weights."""
    layout = make_layout(col, rank, world)
    try:
        built = build(row, col, layout)
    except Exception as error:  # a refusal: every rank must raise it, before communicating
        dist.barrier()
        return {"refused": (type(error), str(error))}
    if col == "to_device":  # transformers.Trainer's call, and a dtype no-op
        built.model.to(torch.device("cpu", 0))
        built.model.float()
    comms = _install_comm_hooks(built) if col == "comm_hooks" else []
    called, compiler = ecosystem_cases.compiled(col, built.model, unit_class(col))
    built = dataclasses.replace(built, model=called)
    _check_tied_and_frozen(built, col, trained=False)
    losses, evals = [], []
    for step in range(STEPS):
        if col == "dcp_resume" and step == SAVE_AFTER:
            save_checkpoint(ckpt, built.state_model, built.optimizer)
            built = build(row, col, layout, seed=123)  # another init: the load must win
            load_checkpoint(ckpt, built.state_model, built.optimizer)
        if col in ecosystem_cases.ROUND_TRIPS and step == SAVE_AFTER:
            load = ecosystem_cases.round_trip(col, torch_sd_model(built), built.optimizer, ckpt)
            built = build(row, col, layout, seed=123)
            load(torch_sd_model(built), built.optimizer)
        try:
            losses.append(train_step(built, row, col, step, layout))
        except Exception as error:  # an optimizer built after wrapping is refused here
            if step > 0 or col not in ecosystem_cases.REFUSED_AT_FIRST_FORWARD:
                raise
            dist.barrier()
            return {"refused": (type(error), str(error))}
        if col == "train_eval":
            evals.append(eval_loss(built, col, layout))
    assert compiler is None or compiler.graphs > 0, f"{col}: torch.compile compiled nothing"
    _check_tied_and_frozen(built, col, trained=True)
    _check_post_forward_groups(built, col)
    _check_comm_hooks(comms)
    # Plain lists: tensors sent back from a rank would travel as shared-memory handles that
    # die with the rank.
    weights = {k: v.tolist() for k, v in final_weights(built, col, layout).items()}
    return {"losses": losses, "evals": evals, "weights": weights}
