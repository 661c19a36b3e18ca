"""``accelerate`` over a model megatron-fsdp sharded (issue 30): ``MegatronFSDPAccelerator``.

``prepare(model, optimizer, dataloader)`` must hand our model back as it is (no DDP wrap: a
plain ``Accelerator`` ends in DDP's ``_sync_module_states`` with a reshape error), and the
loop accelerate users write (``accumulate``, ``backward``, ``clip_grad_norm_`` when gradients
sync) must train as a plain ``Accelerator`` trains the unsharded model under DDP: losses
within 1e-5 relative over 10 optimizer steps of 2 micro-batches, for each entry point.
``get_state_dict`` gives the unsharded weights; ``save_state`` refuses with our way.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hf_cases import Tokens, llama
from llama_entry_points import wrap_llama

from mfsdp_collectives.testing import run_distributed

pytest.importorskip("accelerate")

STEPS = 10


def _loop(accelerator: Any, model: Any, optimizer: Any) -> tuple[Any, list[float]]:
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses: list[float] = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), reduction="mean")))
    return model, losses[: 2 * STEPS]


def _ddp_and_ours(rank: int, world: int, api: str, options: dict[str, Any], out: str) -> Any:
    from accelerate import Accelerator

    from megatron_fsdp.integrations.accelerate import MegatronFSDPAccelerator

    plain = llama()
    ddp_model, ddp_losses = _loop(
        Accelerator(cpu=True, gradient_accumulation_steps=2),
        plain,
        torch.optim.AdamW(plain.parameters(), lr=1e-2),
    )
    assert isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel)
    accelerator = MegatronFSDPAccelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer = wrap_llama(api, llama(), lr=1e-2, **options)
    prepared, losses = _loop(accelerator, model, optimizer)
    assert prepared is model  # no DDP, no copy
    state = accelerator.get_state_dict(prepared)
    difference = 0.0
    if rank == 0:
        want = ddp_model.module.state_dict()
        assert set(state) == set(want)
        difference = max(float((state[k] - v).abs().max()) for k, v in want.items())
    with pytest.raises(NotImplementedError, match=r"mfsdp_checkpoint\.save_checkpoint"):
        accelerator.save_state(out)
    return ddp_losses, losses, difference


_FULL_ONLY = pytest.mark.skipif(
    os.environ.get("MFSDP_FULL_MATRIX") != "1", reason="MFSDP_FULL_MATRIX=1 only"
)


@pytest.mark.parametrize(
    ("api", "options"),
    [
        pytest.param("seed", {}, id="seed"),
        pytest.param(
            "model_optimizer", {"zero_dp_strategy": 1}, id="fully_shard_model", marks=_FULL_ONLY
        ),
        pytest.param("per_module", {}, id="per_module", marks=_FULL_ONLY),
    ],
)
def test_prepare_leaves_the_sharded_model_alone_and_trains_as_ddp(
    api: str, options: dict[str, Any], tmp_path: Any
) -> None:
    ddp_losses, losses, difference = run_distributed(
        _ddp_and_ours, 2, api, options, str(tmp_path), timeout=180
    )[0]
    assert len(losses) == 2 * STEPS
    assert losses[-1] < losses[0] - 0.05, losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), rtol=1e-5, atol=0)
    assert difference < 1e-5  # get_state_dict: the weights DDP trained
