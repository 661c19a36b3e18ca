"""mfsdp-te as it stands: detection of Transformer Engine."""

from __future__ import annotations

import importlib.util

import pytest

import mfsdp_te


def test_detects_transformer_engine_from_the_import_system(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert mfsdp_te.transformer_engine_available() is False
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert mfsdp_te.transformer_engine_available() is True


@pytest.mark.cuda
@pytest.mark.skipif(
    not mfsdp_te.transformer_engine_available(),
    reason="Transformer Engine is not installed (it needs CUDA to build); the TE path runs there",
)
def test_transformer_engine_imports_where_installed() -> None:
    import transformer_engine.pytorch as te  # type: ignore[import-not-found]

    assert hasattr(te, "Linear")
