"""Which names are Megatron-LM's split SwiGLU halves (``<fused linear_fc1>_w``/``_v``), whose
group fields Megatron-LM keeps under the fused name: only a gated MLP's fused ``linear_fc1``
weight or bias (``fsdp_dtensor_checkpoint.is_swiglu_key``), as the Megatron-Core checkpoint
splits them. Any other name ending in ``_w``/``_v`` keeps its own group fields (the group-meta
load once took every such name under a ``linear_fc1`` for a half, and lost its fields)."""

from __future__ import annotations

import pytest

from mfsdp_checkpoint.megatron_optim import is_swiglu_key, plan_group_meta_load

FUSED = "decoder.layers.0.mlp.linear_fc1.weight"
OWN = "decoder.layers.0.mlp.linear_fc1.gate_w"  # a parameter of its own, named ..._w


def test_only_the_halves_of_a_fused_linear_fc1_take_its_group_fields() -> None:
    ours = {
        "state": {f"module.{n}": {} for n in (f"{FUSED}_w", f"{FUSED}_v", OWN)},
        "param_groups": [{"lr": 0.1, "params": [f"module.{FUSED}", f"module.{OWN}"]}],
    }
    theirs = {
        f"module.module.{FUSED}": {"lr": 0.5, "step": 3},
        f"module.module.{OWN}": {"lr": 0.25, "step": 3},
    }
    plan = plan_group_meta_load(ours, {}, theirs)
    assert plan.meta[f"module.{FUSED}_w"]["lr"] == plan.meta[f"module.{FUSED}_v"]["lr"] == 0.5
    assert plan.meta[f"module.{OWN}"]["lr"] == 0.25


@pytest.mark.parametrize(
    ("name", "fused"),
    [
        (FUSED, True),
        ("module.module.decoder.layers.3.mlp.linear_fc1.bias", True),
        ("decoder.layers.0.mlp.experts.local_experts.7.linear_fc1.weight", True),
        ("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", True),
        (OWN, False),
        ("decoder.layers.0.mlp.linear_fc1_extra.weight", False),
        ("decoder.layers.0.mlp.linear_fc1.weight_w", False),  # a half, not the fused key
        ("decoder.layers.0.mlp.linear_fc2.weight", False),
        ("decoder.layers.0.self_attention.linear_fc1.weight", False),  # not an MLP's
    ],
)
def test_the_one_rule_for_a_fused_linear_fc1(name: str, fused: bool) -> None:
    """The rule the Megatron-Core checkpoint splits the model and optimizer state by and the
    group-meta load names the halves by (both ask ``is_swiglu_key``): Megatron-LM's keys."""
    assert is_swiglu_key(name) is fused
