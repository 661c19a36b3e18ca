"""A Hugging Face model trains sharded and exports to a directory ``from_pretrained`` reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_fsdp import fully_shard_model, fully_shard_optimizer
from mfsdp_collectives.testing import run_distributed

transformers = pytest.importorskip("transformers")


def _config() -> object:
    return transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=64,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))


def _reference(steps: int) -> list[float]:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        batch = _batch(step)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _train_and_export(rank: int, world: int, export: str) -> tuple[list[float], dict[str, Any]]:
    import mfsdp_checkpoint

    torch.manual_seed(0)
    model = fully_shard_model(
        transformers.GPT2LMHeadModel(_config()),
        fsdp_unit_modules=["transformers.models.gpt2.modeling_gpt2.GPT2Block"],
    )
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = []
    for step in range(4):
        batch = _batch(step).chunk(world)[rank]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    state = mfsdp_checkpoint.gather_full_state_dict(model)
    hf_state = {k.removeprefix("module."): v for k, v in state.items()}
    if rank == 0:
        plain = transformers.GPT2LMHeadModel(_config())
        plain.load_state_dict(hf_state, strict=True)
        plain.save_pretrained(export)
    torch.distributed.barrier()
    # numpy arrays travel back by plain pickling (tensors would go through shared memory).
    return losses, {k: v.numpy() for k, v in hf_state.items()}


def test_gpt2_trains_sharded_and_round_trips_through_from_pretrained(tmp_path: Path) -> None:
    export = tmp_path / "gpt2"
    losses, state = run_distributed(_train_and_export, 2, str(export), timeout=180)[0]
    # Each rank's loss is a mean over its own tokens, so the mean of the two is the global mean.
    expected = _reference(4)
    for got, want in zip(losses, expected, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, expected)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(export)
    assert loaded.config.n_layer == 2
    loaded_state = loaded.state_dict()
    for key, value in state.items():
        assert torch.equal(loaded_state[key], torch.from_numpy(value)), key
