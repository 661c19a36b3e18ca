"""mypy --strict reports a misspelt option wherever it is passed on the way to the engine.

The public functions take every option as an explicit, typed parameter (no ``**kwargs``),
and the options reach the engine as one frozen record (``mfsdp_hooks.ShardingOptions``), so a
typo is a type error, not a silent default. Between the entry points, the signatures repeat
each other exactly (``test_megatron_fsdp_signatures.py``). Runs mypy on snippets (the nox test
sessions install mypy; skipped where it is not installed).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

PRELUDE = """
import torch
from torch import nn

import megatron_fsdp
import mfsdp_hooks
from megatron_fsdp.engine_options import sharding_options

model = nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
"""

# Each call passes one option, spelt right or wrong as its {o} placeholder is filled.
CALLS = {
    "fully_shard_model": "megatron_fsdp.fully_shard_model(model, {o}=3)",
    "fully_shard": "megatron_fsdp.fully_shard(model, optimizer, {o}=3)",
    "sharding_options": "sharding_options(model, {o}=3)",
    "ShardingOptions": "mfsdp_hooks.ShardingOptions({o}=mfsdp_hooks.ShardingStrategy(3))",
    "FSDPRootWrapper": (
        "mfsdp_hooks.FSDPRootWrapper(model, None, mfsdp_hooks.ShardingOptions({o}="
        "mfsdp_hooks.ShardingStrategy(3)))"
    ),
}
CONFIG_CALLS = {
    "DistributedDataParallelConfig": "megatron_fsdp.DistributedDataParallelConfig({o}=True)",
    "MegatronFSDP": "megatron_fsdp.MegatronFSDP(model, None, {o}=True)",
}


def _mypy(tmp_path: Path, body: str) -> str:
    api = pytest.importorskip("mypy.api")
    snippet = tmp_path / "snippet.py"
    snippet.write_text(PRELUDE + body)
    config = str(ROOT / "pyproject.toml")
    stdout, stderr, _ = api.run([str(snippet), "--strict", "--config-file", config])
    return stdout + stderr


def test_the_right_names_type_check(tmp_path: Path) -> None:
    body = "\n".join(call.format(o="zero_dp_strategy") for call in CALLS.values())
    body += "\n" + "\n".join(call.format(o="nccl_ub") for call in CONFIG_CALLS.values())
    report = _mypy(tmp_path, body + "\n")
    assert "Success: no issues found" in report, report


def test_a_misspelt_option_is_a_type_error_at_every_hop(tmp_path: Path) -> None:
    calls = [call.format(o="zero_dp_stratgy") for call in CALLS.values()]
    calls += [call.format(o="nccl_ubb") for call in CONFIG_CALLS.values()]
    report = _mypy(tmp_path, "\n".join(calls) + "\n")
    first = PRELUDE.count("\n") + 1
    for line, name in enumerate([*CALLS, *CONFIG_CALLS], start=first):
        typo = "nccl_ubb" if name in CONFIG_CALLS else "zero_dp_stratgy"
        assert f'snippet.py:{line}: error: Unexpected keyword argument "{typo}"' in report, (
            name,
            report,
        )
