"""Smoke check run by `nox -s build` inside a venv that holds only the built wheels."""

from importlib.metadata import version

import megatron_fsdp
import mfsdp_buffers
import mfsdp_checkpoint
import mfsdp_collectives
import mfsdp_hooks
import mfsdp_te

for module in (mfsdp_buffers, mfsdp_collectives, mfsdp_hooks, mfsdp_checkpoint, mfsdp_te):
    dist_name = module.__name__.replace("_", "-")
    assert version(dist_name) == module.__version__, (dist_name, module.__version__)
assert hasattr(megatron_fsdp, "__version__")
print("smoke import ok:", {m.__name__: m.__version__ for m in (megatron_fsdp, mfsdp_buffers)})
