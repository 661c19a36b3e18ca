"""A tiny Llama and learnable token data for the Hugging Face integration tests (Trainer,
accelerate): the same model and batches on every rank and in every reference run."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

PROBE = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8]])
"""A fixed input whose logits compare a sharded model with its export."""


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Arithmetic runs (start, start + stride, ...) mod 64: learnable in a few steps."""

    def __init__(self, sequences: int = 80, length: int = 16, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, 64, (sequences, 1), generator=generator)
        stride = torch.randint(1, 4, (sequences, 1), generator=generator)
        self.tokens = (start + stride * torch.arange(length)) % 64

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def llama(**config: Any) -> Any:
    """A seeded 2-layer Llama; ``config`` overrides ``LlamaConfig`` fields."""
    torch.manual_seed(0)
    settings = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
        "tie_word_embeddings": False,
    }
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**(settings | config)))
