"""Make the package importable when the tests run from a plain checkout.

In the uv workspace (and in nox) the package is installed and this does
nothing; running ``python -m pytest packages/mfsdp-collectives/tests`` on a
bare interpreter falls back to ``src/``. Rank processes inherit ``sys.path``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("mfsdp_collectives") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
