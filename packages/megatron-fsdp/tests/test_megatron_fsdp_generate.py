"""Hugging Face ``generate()`` on a sharded model and its export for ``from_pretrained``
(issue 30), through each entry point.

Ranks that stop at different lengths must all return: transformers keeps them in step
(``synced_gpus``) only for modules marked ``_is_fsdp_managed_module``, as torch's
``fully_shard`` marks them; unmarked, the rank that stops first leaves the other waiting in
an all-gather (here: the test's timeout). The seed API's wrapper answers ``generate`` and
``config`` from the wrapped model. Tokens must equal the unsharded model's greedy ones.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_cases import llama
from llama_entry_points import wrap_llama

from mfsdp_checkpoint import save_full_state_dict
from mfsdp_collectives.testing import run_distributed

transformers = pytest.importorskip("transformers")

NEW_TOKENS = (3, 9)  # per rank: rank 0 stops after 3 new tokens, rank 1 after 9
PROMPT = torch.tensor([[5, 17, 3, 42, 8, 11]])


def _llama() -> Any:
    # No end-of-sequence token: each rank generates exactly its NEW_TOKENS.
    return llama(eos_token_id=None, pad_token_id=0).eval()


def _generate(rank: int, world: int, api: str) -> list[int]:
    caller, _ = wrap_llama(api, _llama(), lr=1e-3)
    assert caller.config.vocab_size == 64  # the wrapped model's, through the wrapper
    with torch.no_grad():
        out = caller.generate(PROMPT, max_new_tokens=NEW_TOKENS[rank], do_sample=False)
    return [int(t) for t in out[0]]


@pytest.mark.parametrize(
    "api", ["seed", pytest.param("model_optimizer", id="fully_shard_model"), "class", "per_module"]
)
def test_generate_returns_on_ranks_that_stop_at_different_lengths(api: str) -> None:
    plain = _llama()
    with torch.no_grad():
        want = plain.generate(PROMPT, max_new_tokens=max(NEW_TOKENS), do_sample=False)[0]
    results = run_distributed(_generate, 2, api, timeout=60)
    for rank, tokens in enumerate(results):
        expected = want[: PROMPT.shape[1] + NEW_TOKENS[rank]].tolist()
        assert tokens == expected, (api, rank, tokens, expected)


def _export(rank: int, world: int, api: str, out: str) -> list[float]:
    """The root README's "Export for Hugging Face" snippet; returns the sharded logits."""
    model, _ = wrap_llama(api, _llama(), lr=1e-3)
    save_full_state_dict(model, f"{out}/model.safetensors", strip_prefix="module.")
    if rank == 0:
        model.config.save_pretrained(out)  # the wrapper answers .config from the model
    torch.distributed.barrier()
    with torch.no_grad():
        return [float(v) for v in model(PROMPT).logits.flatten()]


@pytest.mark.parametrize("api", ["seed", "per_module"])
def test_the_export_snippet_writes_what_from_pretrained_loads(api: str, tmp_path: Any) -> None:
    out = str(tmp_path / "export")
    sharded = run_distributed(_export, 2, api, out, timeout=60)[0]
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = reloaded(PROMPT).logits.flatten()
    torch.testing.assert_close(logits, torch.tensor(sharded), rtol=1e-5, atol=1e-6)


def _save_pretrained(rank: int, world: int, api: str, out: str) -> list[float]:
    """``save_pretrained`` on what each API hands the user: the root wrapper's method, or
    ``megatron_fsdp.hf_export.save_pretrained`` for a per-module root (its own
    ``save_pretrained`` is Hugging Face's, which cannot read uneven row shards)."""
    from megatron_fsdp.hf_export import save_pretrained

    model, _ = wrap_llama(api, _llama(), lr=1e-3)
    if api == "per_module":
        save_pretrained(model, out)
    else:
        model.save_pretrained(out)
        with pytest.raises(TypeError, match="safe_serialization"):
            model.save_pretrained(out, safe_serialization=True)
    with torch.no_grad():
        return [float(v) for v in model(PROMPT).logits.flatten()]


@pytest.mark.parametrize("api", ["seed", "class", "per_module"])
def test_save_pretrained_writes_what_from_pretrained_loads(api: str, tmp_path: Any) -> None:
    out = str(tmp_path / "saved")
    sharded = run_distributed(_save_pretrained, 2, api, out, timeout=60)[0]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == "LlamaForCausalLM"
    assert reloaded.config.architectures == ["LlamaForCausalLM"]
    with torch.no_grad():
        logits = reloaded(PROMPT).logits.flatten()
    torch.testing.assert_close(logits, torch.tensor(sharded), rtol=1e-5, atol=1e-6)
