"""torch's full optimizer state dict of our models equals one process's, whatever each rank's
hash seed.

``get_optimizer_state_dict(..., full_state_dict=True)`` gathers each parameter's state key by
key in dict order, so every rank must hold its state keys in one order. Under torchrun each
rank hashes strings its own way: anything that orders keys through a set pairs one rank's
``exp_avg`` with another's ``exp_avg_sq``. The ranks here start with different
``PYTHONHASHSEED`` values (checked to order a set of the state keys differently), as torchrun's
would.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from toy_entry_points import shard_toy

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing import make_batches, make_model, train_data_parallel, train_single_process

STEPS = 3
ADAM_KEYS = ["step", "exp_avg", "exp_avg_sq"]
HASH_SEEDS = [0, 1]  # order set(ADAM_KEYS) differently (asserted below)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    full = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True)
    )
    return cast(dict[str, Any], full["state"])


def _compare(rank: int, world: int, apis: list[str]) -> dict[str, Any]:
    batches = make_batches(STEPS)
    reference = make_model()
    reference_optimizer = _adamw(reference)
    train_single_process(reference, reference_optimizer, batches)
    expected = _full_state(reference, reference_optimizer)
    report: dict[str, Any] = {"set_order": list(set(ADAM_KEYS))}
    for api in apis:
        model, optimizer = shard_toy(api, world, _adamw)
        train_data_parallel(model, optimizer, batches, rank, world)
        state = _full_state(model, optimizer)
        # Keyed by FQN, as FSDP2's: the seed API's wrapper puts its module. level in front.
        wrapper = "module." if api == "seed" else ""
        by_name = {str(k).removeprefix(wrapper): v for k, v in state.items()}
        errors, orders = {}, {}
        for name, entry in expected.items():
            got = by_name[name]
            orders[name] = (list(got), list(entry))
            for key, value in entry.items():
                mine = got[key]
                assert mine.shape == value.shape, f"{api} {name}.{key}: {mine.shape}"
                errors[f"{name}.{key}"] = (mine.float() - value.float()).abs().max().item()
        report[api] = {"keys": [type(k).__name__ for k in state], "errors": errors}
        report[api]["orders"] = orders
    return report


def test_full_optimizer_state_dict_matches_one_process_with_per_rank_hash_seeds() -> None:
    apis = ["seed", "per_module_attach"]
    reports = run_distributed(_compare, 2, apis, timeout=240, hash_seeds=HASH_SEEDS)
    assert reports[0]["set_order"] != reports[1]["set_order"], "the seeds must disagree"
    for rank, report in enumerate(reports):
        for api in apis:
            errors = report[api]["errors"]
            worst = max(errors, key=errors.get)
            assert errors[worst] < 1e-6, f"rank {rank}, {api}: {worst} off by {errors[worst]:.2e}"
            for name, (got, expected) in report[api]["orders"].items():
                assert got == expected, f"rank {rank}, {api}, {name}: state keys in order {got}"
    for api in apis:
        assert set(reports[0][api]["keys"]) == {"str"}, api  # FQNs, as FSDP2's
