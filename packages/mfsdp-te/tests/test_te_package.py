"""mfsdp-te as it stands: detection of Transformer Engine and the optional extra."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import mfsdp_te

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def test_detects_transformer_engine_from_the_import_system(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert mfsdp_te.transformer_engine_available() is False
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert mfsdp_te.transformer_engine_available() is True


def test_te_extra_pulls_transformer_engine_pytorch() -> None:
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert extras["te"] == ["transformer-engine[pytorch]"]


@pytest.mark.cuda
@pytest.mark.skipif(
    not mfsdp_te.transformer_engine_available(),
    reason="Transformer Engine is not installed (it needs CUDA to build); the TE path runs there",
)
def test_transformer_engine_imports_where_installed() -> None:
    import transformer_engine.pytorch as te  # type: ignore[import-not-found]

    assert hasattr(te, "Linear")
