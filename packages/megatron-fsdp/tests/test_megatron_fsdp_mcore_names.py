"""Whole-model names of a Megatron-Core chunk's tensors (``megatron_fsdp.mcore_names``) and
the checkpoint directory's errors (``megatron_fsdp.mcore_checkpoint``), without
megatron-core: modules with its public ``layer_number`` / ``local_expert_indices``."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from megatron_fsdp.mcore_checkpoint import latest_iteration, load_fsdp_dtensor
from megatron_fsdp.mcore_names import LayoutFreeNames
from mfsdp_checkpoint import split_wrappers


class Experts(nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(count))


class MoE(nn.Module):
    def __init__(self, first_expert: int, count: int) -> None:
        super().__init__()
        self.experts = Experts(count)
        self.local_expert_indices = list(range(first_expert, first_expert + count))


class Layer(nn.Module):
    def __init__(self, layer_number: int, moe: MoE | None = None) -> None:
        super().__init__()
        self.layer_number = layer_number  # Megatron-Core's: from 1, across stages
        self.norm = nn.LayerNorm(2)
        self.mlp = moe if moe is not None else nn.Linear(2, 2)


class Stage(nn.Module):
    """The second of two pipeline stages (layers 3 and 4 of 4), the second expert rank's
    experts (2 and 3 of 4) in its MoE layer, wrapped twice as the adapter wraps it."""

    def __init__(self) -> None:
        super().__init__()
        decoder = nn.Module()
        decoder.layers = nn.ModuleList([Layer(3), Layer(4, MoE(2, 2))])
        inner = nn.Module()
        inner.decoder = decoder
        middle = nn.Module()
        middle.module = inner
        self.module = middle


def test_stage_local_names_become_the_whole_models_and_back() -> None:
    names = LayoutFreeNames(Stage())
    pairs = {
        "decoder.layers.0.norm.weight": "decoder.layers.2.norm.weight",
        "decoder.layers.1.mlp.experts.local_experts.0.weight": (
            "decoder.layers.3.mlp.experts.local_experts.2.weight"
        ),
        "decoder.layers.1.mlp.experts.local_experts.1.bias": (
            "decoder.layers.3.mlp.experts.local_experts.3.bias"
        ),
        "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    }
    for local, whole in pairs.items():
        assert names.to_global(local) == whole
        assert names.to_local(whole) == local
    assert split_wrappers("module.module.decoder.x") == ("module.module.", "decoder.x")


def test_a_directory_without_the_tracker_file_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"latest_checkpointed_iteration\.txt"):
        latest_iteration(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release\n")
    assert latest_iteration(tmp_path) == "release"
    with pytest.raises(TypeError, match="chunks must be a non-empty list"):
        load_fsdp_dtensor(tmp_path, [], None)
