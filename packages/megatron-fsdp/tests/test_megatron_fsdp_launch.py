"""A script that never calls ``init_process_group``: under torchrun the default group is
initialised for it (as FSDP2 does), and without a launcher the error names the fix.

Each case runs in a fresh interpreter, so that no process group of another test exists and
the environment is exactly the launcher's (or none at all).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

SCRIPT = r"""
import logging, sys
import torch
from torch import nn
import megatron_fsdp

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")

class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        return torch.relu(self.linear(x)) + x

torch.manual_seed(0)
model = nn.Sequential(Layer(), Layer(), nn.Linear(6, 1))
try:
    model = megatron_fsdp.fully_shard_model(model, fsdp_unit_modules=[Layer])
except RuntimeError as error:
    print("ERROR:", error)
    sys.exit(3)
optimizer = megatron_fsdp.fully_shard_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
batch = torch.randn(4, 6)
losses = []
for _ in range(2):
    loss = model(batch).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
print("LOSSES", losses, torch.distributed.get_backend(), torch.distributed.get_world_size())
torch.distributed.destroy_process_group()
"""

# Whatever a launcher around pytest itself exported: each case sets its own.
_LAUNCHER_VARS = frozenset(
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    | {"GROUP_RANK", "TORCHELASTIC_RUN_ID"}
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _run(launcher_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(launcher_env, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_torchrun_environment_initialises_the_default_group() -> None:
    torchrun = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }
    done = _run(torchrun)
    assert done.returncode == 0, done.stdout + done.stderr
    losses_line = next(line for line in done.stdout.splitlines() if line.startswith("LOSSES"))
    losses = [float(x) for x in losses_line.split("[")[1].split("]")[0].split(",")]
    assert losses[1] < losses[0], losses  # it trained
    assert losses_line.endswith("gloo 1"), losses_line
    assert (
        "mfsdp_collectives.topology initialised torch.distributed's default process group "
        "from the launcher's environment (backend 'gloo', rank 0 of 1)"
    ) in done.stdout, done.stdout


def test_without_a_launcher_the_error_names_the_fix() -> None:
    done = _run({})
    assert done.returncode == 3, done.stdout + done.stderr
    message = done.stdout
    assert "ERROR: fully_shard needs torch.distributed's default process group" in message
    assert "['RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'] are not set" in message
    assert "torchrun --nproc-per-node=N" in message
    assert "torch.distributed.init_process_group(backend='gloo')" in message
    assert "FSDPTopology" not in message, message
