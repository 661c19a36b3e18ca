"""The seed API checkpointed with plain ``dcp.save``/``dcp.load``, as FSDP2 users write it.

``megatron_fsdp.fully_shard(model, optimizer)`` turns on ``mfsdp_checkpoint.enable_dcp``
(``preproc_state_dict_for_dcp_ckpt=True``): ``dcp.save({"model": model.state_dict(),
"optim": optimizer.state_dict()})`` of it resumes exactly, a fresh optimizer included (its
placeholders take the loaded state), and torch's ``dcp_to_torch_save`` writes full tensors.
The per-module API's side is ``mfsdp-hooks/tests/test_hooks_plain_dcp.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import megatron_fsdp
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing.plain_dcp import DCPBlock, check_plain_dcp_resume


def _seed(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[DCPBlock])


def _worker(rank: int, world: int, path: str, then_load: bool) -> int:
    return check_plain_dcp_resume(
        rank, world, path, _seed, model_load_state_dict=then_load, init_state=False
    )


@pytest.mark.parametrize("then_load", [True, False], ids=["load_state_dict", "dcp_load_only"])
def test_plain_dcp_resumes_the_seed_api_exactly(tmp_path: Path, then_load: bool) -> None:
    empties = run_distributed(_worker, 2, str(tmp_path / "ckpt"), then_load, timeout=180)
    assert max(empties) > 0, "no rank held an empty piece: the failing case is not covered"
