"""Megatron-LM's ``--ckpt-format fsdp_dtensor`` checkpoints, both ways (issue 29), with
Megatron-Core's own ``DistributedOptimizer`` (``get_megatron_optimizer``) over the adapter's
chunks.

Megatron-LM's ``training/checkpointing.py`` is not in the megatron-core wheel, so its
fsdp_dtensor branch (0.16: ``generate_state_dict``, ``preprocess_fsdp_dtensor_state_dict``,
``_load_base_checkpoint``) is replayed here step by step with the Megatron-Core functions it
calls: the chunk's ``state_dict_for_save_checkpoint()``, the optimizer's
``sharded_state_dict(metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})``,
``handle_experts_in_state_dict``, ``preprocess_state_dict_for_uneven_dtensor``, a plain
``torch.distributed.checkpoint.save`` into ``iter_<7 digits>`` and the tracker file; on load
the same template with ``is_loading=True``, ``DefaultLoadPlanner(allow_partial_load=False)``
and the chunk's and optimizer's ``load_state_dict``.

* Megatron-LM writes at DP=4 (and at EP=2 x DP=2: experts renamed by Megatron-Core's
  ``handle_experts_in_state_dict``); ``load_fsdp_dtensor`` resumes at TP=2 x DP=2 and at
  PP=2 x DP=2 (and every expert on every rank).
* ``save_fsdp_dtensor`` writes at TP=2 x DP=2 and at PP=2 x DP=2; Megatron-LM's load path
  resumes at DP=2 with Megatron-Core's optimizer. One step of it is done for it first:
  Megatron-Core 0.16's load template (``_init_optimizer_states_with_dummy_values``) makes
  optimizer state with a step on zero gradients but skips parameters whose local shard is
  empty (FusedAdam refuses empty tensors), so a rank with an empty shard lists fewer
  optimizer DTensors than the others and ``preprocess_state_dict_for_uneven_dtensor`` (one
  ``all_gather_object`` per DTensor) pairs different tensors across ranks and hangs. Small
  parameters have empty shards on some ranks here (as under Megatron-Core's own FSDP), so the
  test makes that state for every parameter before the template is built.

Every resumed run continues one process's curve within 1e-5. Megatron-Core's optimizer runs
with ``clip_grad=0`` (its clipping asserts CUDA tensors) and the loop clips with
``megatron_fsdp.mcore_grad_norm.clip_grad_norm`` as every other test here; weight decay is 0
(Megatron-Core exempts biases and norms from it, torch's AdamW in the reference does not).
Needs megatron-core (``nox -s mcore``).
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

pytest.importorskip("megatron.core", reason="megatron-core is not installed (nox -s mcore)")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    from megatron.core import parallel_state
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.fsdp_dtensor_checkpoint import (
        handle_experts_in_state_dict,
        handle_fp8_extra_state_case,
    )

from mcore_cpu import CudaOnCpu
from test_mcore_parallelism import (
    LR,
    RESUME_LAYOUTS,
    RTOL,
    STEPS,
    _reference,
    _start,
    _torch_steps,
    _train,
)
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from megatron_fsdp.mcore_checkpoint import load_fsdp_dtensor, save_fsdp_dtensor
from mfsdp_collectives.testing import run_distributed

HALF = STEPS // 2
ZERO = "optim_grads_params"
# Megatron-LM saves its argparse Namespace as one object, and its load template asks for it.
ARGS = argparse.Namespace(ckpt_format="fsdp_dtensor", use_megatron_fsdp=True)
_SHARDING = {"distrib_optim_sharding_type": "fsdp_dtensor", "chained_optim_avoid_prefix": True}


def _megatron_optimizer(chunks: list[Any]) -> Any:
    config = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        weight_decay=0.0,
        clip_grad=0.0,
        use_distributed_optimizer=True,
        bf16=False,
        fp16=False,
    )
    with CudaOnCpu():  # its overflow flag is made on device="cuda"
        return get_megatron_optimizer(config, chunks)


def _megatron_lm_state(chunks: list[Any], optimizer: Any, loading: bool) -> dict[str, Any]:
    """Megatron-LM 0.16's ``generate_state_dict`` + ``preprocess_fsdp_dtensor_state_dict``
    for fsdp_dtensor, one chunk (its save refuses several: names conflict)."""
    (chunk,) = chunks
    with CudaOnCpu():
        optimizer_state = optimizer.sharded_state_dict({}, is_loading=loading, metadata=_SHARDING)
    state: dict[str, Any] = {
        "args": ARGS,
        "checkpoint_version": 3.0,
        "iteration": HALF,
        "model": chunk.state_dict_for_save_checkpoint(),
        "optimizer": optimizer_state,
    }
    handle_fp8_extra_state_case(state["model"])
    if chunk.config.num_moe_experts:
        state["model"] = handle_experts_in_state_dict(state["model"], chunk.config.num_moe_experts)
    preprocess_state_dict_for_uneven_dtensor(state)
    return state


def _state_for_every_parameter(optimizer: torch.optim.Optimizer) -> None:
    """What Megatron-Core's load template does (a step on zero gradients, so the state
    exists to load into), for parameters with an empty local shard too: see the module
    docstring."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad()


def _megatron_lm_worker(
    rank: int, world: int, layout: str, initial: dict[str, list[Any]], path: str, saves: bool
) -> list[float]:
    """Megatron-LM's side: train the first half and save, or load and train the second."""
    chunks = _start(layout, ZERO, initial)
    optimizer = _megatron_optimizer(chunks)
    iteration_dir = Path(path) / f"iter_{HALF:07d}"
    if not saves:
        _state_for_every_parameter(optimizer.optimizer)
        state = _megatron_lm_state(chunks, optimizer, loading=True)
        raw_model, raw_optimizer = state["model"].copy(), state["optimizer"].copy()
        planner = DefaultLoadPlanner(allow_partial_load=False)
        dcp.load(state, checkpoint_id=iteration_dir, planner=planner)
        chunks[0].load_state_dict(raw_model, strict=True)
        optimizer.load_state_dict(raw_optimizer)
    steps = (0, HALF) if saves else (HALF, STEPS)
    losses, _ = _train(chunks, steps, optimizer.zero_grad, optimizer.step)
    if saves:
        dcp.save(_megatron_lm_state(chunks, optimizer, loading=False), checkpoint_id=iteration_dir)
        if dist.get_rank() == 0:
            (Path(path) / "latest_checkpointed_iteration.txt").write_text(str(HALF))
    parallel_state.destroy_model_parallel()
    return losses


def _our_worker(
    rank: int, world: int, layout: str, initial: dict[str, list[Any]], path: str, saves: bool
) -> list[float]:
    """Ours (``megatron_fsdp.mcore_checkpoint``): a Megatron-LM job with the adapter saves
    with Megatron-Core's optimizer (its group fields are what Megatron-LM's strict load asks
    for); the job that resumes uses torch's AdamW, which takes the fields its groups have."""
    chunks = _start(layout, ZERO, initial)
    if saves:
        optimizer = _megatron_optimizer(chunks)
        losses, _ = _train(chunks, (0, HALF), optimizer.zero_grad, optimizer.step)
        save_fsdp_dtensor(path, chunks, optimizer, iteration=HALF, extra={"args": ARGS})
        parallel_state.destroy_model_parallel()
        return losses
    optimizers = [torch.optim.AdamW(c.parameters(), lr=LR, weight_decay=0.0) for c in chunks]
    assert load_fsdp_dtensor(path, chunks, optimizers)["iteration"] == HALF
    losses, _ = _train(chunks, (HALF, STEPS), *_torch_steps(chunks, optimizers))
    parallel_state.destroy_model_parallel()
    return losses


WORKERS = {"megatron-lm": _megatron_lm_worker, "ours": _our_worker}


@pytest.mark.parametrize(
    ("writer", "saved_at", "reader", "resumed_at"),
    [
        ("megatron-lm", "dp4", "ours", "tp2_dp2"),
        ("megatron-lm", "dp4", "ours", "pp2_dp2"),
        ("megatron-lm", "ep2_dp2", "ours", "moe_dp2"),
        ("ours", "tp2_dp2", "megatron-lm", "dp2"),
        ("ours", "pp2_dp2", "megatron-lm", "dp2"),
    ],
)
def test_fsdp_dtensor_checkpoints_move_between_megatron_lm_and_us(
    writer: str, saved_at: str, reader: str, resumed_at: str, tmp_path: Path
) -> None:
    moe = RESUME_LAYOUTS[saved_at].ep > 1
    want, _, initial = _reference(moe, 0.0)
    path = str(tmp_path / "checkpoints")
    ranks = RESUME_LAYOUTS[saved_at].ranks
    first = run(WORKERS[writer], ranks, saved_at, initial, path, True)
    for losses in first:
        assert_close(losses, want[:HALF], (writer, saved_at))
    ranks = RESUME_LAYOUTS[resumed_at].ranks
    second = run(WORKERS[reader], ranks, resumed_at, initial, path, False)
    assert len(second) == ranks // RESUME_LAYOUTS[resumed_at].stages
    for losses in second:
        assert_close(losses, want[HALF:], (writer, saved_at, reader, resumed_at))


def run(worker: Any, ranks: int, *args: Any) -> list[list[float]]:
    """The last stage's losses of each rank that has them."""
    return [losses for losses in run_distributed(worker, ranks, *args, timeout=300) if losses]


def assert_close(got: list[float], want: list[float], what: Any) -> None:
    expected = torch.tensor(want, dtype=torch.float64)
    actual = torch.tensor(got, dtype=torch.float64)
    assert torch.allclose(actual, expected, rtol=RTOL, atol=0), (what, actual, expected)
