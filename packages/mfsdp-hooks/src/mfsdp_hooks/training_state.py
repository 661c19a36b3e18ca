"""Where an FSDP unit is in its forward/backward lifecycle."""

from __future__ import annotations

import enum

import torch


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


def in_backward_pass() -> bool:
    """True while the autograd engine is executing, e.g. during activation recompute."""
    return bool(torch._C._current_graph_task_id() != -1)
