"""Megatron-LM's ``--ckpt-format fsdp_dtensor`` checkpoints of the adapter's model chunks,
loadable under any TP/PP/VPP/EP/DP layout (layout and names: the package README). Several
chunks save as one model (Megatron-LM's ``DistributedOptimizer`` refuses several virtual
chunks: "Parameter names conflict between model chunks").

Transformer Engine's ``_extra_state`` entries are left out, as Megatron-LM leaves them out.
A SwiGLU ``linear_fc1`` is saved as ``<key>_w`` and ``<key>_v``, each TP rank's halves
stacked over TP (views of the fused tensor, so a load fills it): a layout free of TP.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_fsdp.mcore_names import LayoutFreeNames
from mfsdp_checkpoint import (
    WRAPPER_PREFIX,
    enable_dcp,
    has_row_chunk,
    is_swiglu_key,
    load,
    named_optimizer_state_dict,
    save,
    split_rows,
    split_wrappers,
    swiglu_halves,
    to_megatron_optimizer_state,
)

__all__ = ["TRACKER", "latest_iteration", "load_fsdp_dtensor", "save_fsdp_dtensor"]

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
_EXTRA_STATE = "._extra_state"


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """A torch optimizer, several, or Megatron-Core's ``DistributedOptimizer`` (whose torch
    optimizer, ``.optimizer``, holds the state under Megatron-FSDP)."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return [inner]
    if isinstance(optimizer, Sequence):
        return [o for each in optimizer for o in _torch_optimizers(each)]
    raise TypeError(
        "optimizer must be a torch.optim.Optimizer, a list of them, Megatron-Core's "
        f"DistributedOptimizer or None; got {type(optimizer).__name__}"
    )


class _ChunkState:
    """The DCP state dict of a list of chunks (and their optimizers) under whole-model names,
    and the way back to each chunk's and optimizer's own names."""

    def __init__(
        self, chunks: nn.Module | Sequence[nn.Module], optimizers: list[torch.optim.Optimizer]
    ):
        if isinstance(chunks, nn.Module):
            chunks = [chunks]
        if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
            raise TypeError("chunks must be a non-empty list of the adapter's model chunks")
        self.chunks = list(chunks)
        self.names = [LayoutFreeNames(chunk) for chunk in self.chunks]
        self.optimizers = optimizers
        self.model_keys: list[dict[str, str]] = []  # per chunk: whole-model key -> own key
        self.whole_model: dict[str, Any] = {}  # whole-model key -> the chunk's value
        for chunk, names in zip(self.chunks, self.names, strict=True):
            enable_dcp(chunk)  # the adapter did; a fully_shard_model chunk may not have
            own: dict[str, str] = {}
            for key, value in chunk.state_dict().items():
                if key.endswith(_EXTRA_STATE):
                    continue
                global_key = WRAPPER_PREFIX + names.to_global(split_wrappers(key)[1])
                own[global_key] = key
                self.whole_model[global_key] = value
            self.model_keys.append(own)
        configs = [getattr(chunk, "config", None) for chunk in chunks]
        self.swiglu = any(getattr(c, "gated_linear_unit", False) for c in configs)
        self.model = self._split_swiglu(self.whole_model)
        self.own_names: list[dict[str, str]] = []  # per optimizer: whole-model -> own name
        self.optimizer_states = [self._optimizer_state(o) for o in optimizers]

    def _global_name(self, name: str) -> str:
        """An optimizer name (``<chunk index>.<chunk's parameter name>``) as the whole
        model's, keeping the chunk's wrapper levels as Megatron-Core's optimizer names do."""
        index, _, own = name.partition(".")
        wrappers, path = split_wrappers(own)
        return wrappers + self.names[int(index)].to_global(path)

    def _optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = named_optimizer_state_dict(nn.ModuleList(self.chunks), optimizer)
        own = {self._global_name(n): n for g in state["param_groups"] for n in g["params"]}
        self.own_names.append(own)
        return _renamed(state, {n: g for g, n in own.items()})

    def _split_swiglu(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Megatron-LM's SwiGLU ``linear_fc1`` (weight and bias) as ``<key>_w`` and
        ``<key>_v`` (``handle_swiglu_in_state_dict``): each TP rank's rows are ``[w; v]``."""
        if not self.swiglu:
            return tensors
        out: dict[str, Any] = {}
        for key, value in tensors.items():
            if is_swiglu_key(key) and isinstance(value, torch.Tensor):
                w, v = swiglu_halves(key)
                out[w], out[v] = split_rows(value, 2, key)
            else:
                out[key] = value
        return out

    def merged_optimizer(self) -> dict[str, Any]:
        """One torch-layout optimizer state of every optimizer (the same entry objects),
        SwiGLU state split as Megatron-LM splits it (group fields stay under the name)."""
        merged: dict[str, Any] = {"state": {}, "param_groups": []}
        for state in self.optimizer_states:
            merged["state"].update(state["state"])
            merged["param_groups"].extend(state["param_groups"])
        if self.swiglu:
            split: dict[str, Any] = {}
            for name, entry in merged["state"].items():
                if not is_swiglu_key(name):
                    split[name] = entry
                    continue
                w, v = swiglu_halves(name)
                halves = {k: x for k, x in entry.items() if not _row_sharded(x)}
                split[w], split[v] = dict(halves), dict(halves)
                for field, value in entry.items():
                    if _row_sharded(value):
                        split[w][field], split[v][field] = split_rows(value, 2, f"{name}.{field}")
            merged["state"] = split
        return merged

    def load_into_chunks_and_optimizers(self, model: dict[str, Any], strict: bool) -> None:
        """After DCP filled ``model`` (and the split SwiGLU views, so the tensors behind them)."""
        for chunk, own in zip(self.chunks, self.model_keys, strict=True):
            values = {own[k]: model.get(k, self.whole_model[k]) for k in own}
            # TE's _extra_state is not in the checkpoint (as in Megatron-LM's): not missing.
            result = chunk.load_state_dict(values, strict=False)
            missing = [k for k in result.missing_keys if not k.endswith(_EXTRA_STATE)]
            if strict and (missing or result.unexpected_keys):
                raise RuntimeError(
                    f"load_fsdp_dtensor: the chunk's state dict has missing keys {missing} and "
                    f"unexpected keys {result.unexpected_keys}"
                )
        for optimizer, state, own_names in zip(
            self.optimizers, self.optimizer_states, self.own_names, strict=True
        ):
            optimizer.load_state_dict(_renamed(state, own_names))


def _renamed(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """A name-keyed optimizer state dict with every parameter name ``n`` as ``names[n]``."""
    return {
        "state": {names[n]: e for n, e in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[n] for n in g["params"]]} for g in state["param_groups"]
        ],
    }


def _row_sharded(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and has_row_chunk(value)


def _iteration_dir(directory: Path, iteration: int | str) -> Path:
    return directory / ("release" if iteration == "release" else f"iter_{int(iteration):07d}")


def save_fsdp_dtensor(
    directory: str | os.PathLike[str],
    chunks: nn.Module | Sequence[nn.Module],
    optimizer: Any = None,
    *,
    iteration: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save ``chunks`` (this rank's model chunks) and ``optimizer`` at ``iteration`` as
    Megatron-LM does with ``--ckpt-format fsdp_dtensor``. Collective over the world. Returns
    the iteration's directory."""
    if not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be a non-negative int, got {iteration!r}")
    reserved = {"model", "optimizer", "checkpoint_version", "iteration"} & set(extra or {})
    if reserved:
        raise ValueError(f"extra: {sorted(reserved)} are written by save_fsdp_dtensor itself")
    chunk_state = _ChunkState(chunks, _torch_optimizers(optimizer))
    state: dict[str, Any] = {"model": chunk_state.model}
    if chunk_state.optimizers:
        state["optimizer"] = to_megatron_optimizer_state(chunk_state.merged_optimizer())
    state.update(checkpoint_version=CHECKPOINT_VERSION, iteration=iteration, **(extra or {}))
    root = Path(directory)
    target = save(state, _iteration_dir(root, iteration))
    _write_tracker(root, iteration)
    return target


def _write_tracker(root: Path, iteration: int) -> None:
    """Rank 0 names ``iteration`` the latest, atomically (a reader sees the old number or the
    new); its failure is raised on every rank."""
    failure: list[str | None] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            staging = root / f"{TRACKER}.partial"
            staging.write_text(str(iteration))
            os.replace(staging, root / TRACKER)
        except OSError as error:
            failure = [f"{type(error).__name__}: {error}"]
    if dist.is_initialized():
        dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise OSError(f"the checkpoint is saved, but {root / TRACKER} is not: {failure[0]}")


def latest_iteration(directory: str | os.PathLike[str]) -> int | str:
    """The iteration ``latest_checkpointed_iteration.txt`` names (an int, or ``"release"``)."""
    tracker = Path(directory) / TRACKER
    if not tracker.is_file():
        raise FileNotFoundError(
            f"{tracker} does not exist: {directory} holds no Megatron-LM checkpoint; pass the "
            "directory save_fsdp_dtensor (or Megatron-LM's --save) wrote, or iteration="
        )
    text = tracker.read_text().strip()
    return "release" if text == "release" else int(text)


def load_fsdp_dtensor(
    directory: str | os.PathLike[str],
    chunks: nn.Module | Sequence[nn.Module],
    optimizer: Any = None,
    *,
    iteration: int | str | None = None,
    extra: dict[str, Any] | None = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Load the checkpoint at ``iteration`` (default: the tracker file's) into ``chunks`` and
    ``optimizer``, whatever layout wrote it. Collective. Returns ``{"iteration": ...}`` and
    the ``extra`` sections asked for (their given values are the defaults)."""
    root = Path(directory)
    chosen = latest_iteration(root) if iteration is None else iteration
    chunk_state = _ChunkState(chunks, _torch_optimizers(optimizer))
    state: dict[str, Any] = {"model": chunk_state.model, "iteration": 0, **(extra or {})}
    if chunk_state.optimizers:
        state["optimizer"] = chunk_state.merged_optimizer()
    load(state, _iteration_dir(root, chosen), strict=strict, partitioned=True)
    chunk_state.load_into_chunks_and_optimizers(state["model"], strict)
    return {k: v for k, v in state.items() if k not in ("model", "optimizer")}
