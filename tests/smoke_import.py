"""Smoke check run by `nox -s build` inside a venv that holds only what was installed from
the built wheels or by README.md's install lines: every package imports, from the installed
copy, at the version megatron-fsdp pins, and `megatron_fsdp` is ours, not NVIDIA's project of
the same import name."""

import re
import sysconfig
from importlib.metadata import requires, version
from pathlib import Path

import megatron_fsdp
import mfsdp_buffers
import mfsdp_checkpoint
import mfsdp_collectives
import mfsdp_hooks
import mfsdp_te

LAYERS = (mfsdp_buffers, mfsdp_collectives, mfsdp_hooks, mfsdp_checkpoint, mfsdp_te)
SITE = Path(sysconfig.get_paths()["purelib"]).resolve()

pins = {}
for requirement in requires("megatron-fsdp") or []:
    match = re.match(r"^(mfsdp-[a-z]+)==([^\s;]+)$", requirement.strip())
    if match:
        pins[match.group(1)] = match.group(2)
for module in (megatron_fsdp, *LAYERS):
    dist_name = module.__name__.replace("_", "-")
    assert version(dist_name) == module.__version__, (dist_name, module.__version__)
    assert module.__file__ is not None and SITE in Path(module.__file__).resolve().parents, (
        f"{module.__name__} imported from {module.__file__}, not from {SITE}"
    )
# NVIDIA's megatron-fsdp requires none of our layers: empty pins mean theirs was installed.
for module in LAYERS:
    dist_name = module.__name__.replace("_", "-")
    assert pins.get(dist_name) == module.__version__, (dist_name, pins, module.__version__)
print("smoke import ok:", {m.__name__: m.__version__ for m in (megatron_fsdp, *LAYERS)})
