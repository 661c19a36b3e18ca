"""Shared test settings: hypothesis profiles sized for a 2-core CI box.

Also lets ``python -m pytest packages/mfsdp-buffers/tests`` run from a bare
checkout: when the package is not installed, its ``src`` directory is put on
the path. An installed copy (nox, standalone-install checks) always wins.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

if importlib.util.find_spec("mfsdp_buffers") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

settings.register_profile(
    "mfsdp-buffers",
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("mfsdp-buffers-thorough", max_examples=2000, deadline=None)
settings.load_profile("mfsdp-buffers")
