"""What the Llama benchmarks (``host_bound``, ``plan_vs_measured``) share: the model they
build and the shape of the markdown table they print."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

__all__ = ["llama", "markdown_table"]


def llama(
    hidden: int, intermediate: int, layers: int, heads: int, vocab: int, *, max_positions: int
) -> nn.Module:
    """A ``LlamaForCausalLM`` of these sizes (as many key-value heads as query heads) on the
    default device, without a KV cache: training reads none, and a cache keys each layer by
    its index (under ``torch.compile``, one recompile per layer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        use_cache=False,
    )
    model: nn.Module = LlamaForCausalLM(config)
    return model


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table: a header of ``columns``, then one line per row of cells."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
