"""The README's examples run and their assertions hold (docs that drift are worse than none)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    if not README.exists():  # installed without the source tree
        return []
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


@pytest.mark.skipif(not README.exists(), reason="README.md is not next to the tests")
@pytest.mark.parametrize("block", _python_blocks())
def test_readme_example(block: str) -> None:
    exec(compile(block, str(README), "exec"), {})
