"""Run the megatron-fsdp vs FSDP2 benchmark: ``python benchmarks/run.py --help``.

A thin script so both ``python benchmarks/run.py`` and ``nox -s bench`` work from any
working directory: it puts the repository root on the import path (for this process and,
through ``PYTHONPATH``, for the rank processes) and hands over to ``benchmarks.cli``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
)

from benchmarks.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
