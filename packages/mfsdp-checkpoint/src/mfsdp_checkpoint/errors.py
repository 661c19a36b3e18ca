"""The errors this layer raises, so callers can tell a missing checkpoint from a broken one.

Every class derives from ``CheckpointError`` (a ``RuntimeError``). In a distributed job each of
them is raised on every rank with the same message: ranks agree on the outcome of their local
checks before anything raises, so one rank's problem never leaves the others in a collective.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class: something about a checkpoint prevents saving or loading it."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path holds no checkpoint (it is missing, or is not a checkpoint directory/file)."""


class IncompleteCheckpointError(CheckpointError):
    """The checkpoint was never finished: its save was interrupted or is still running."""


class CorruptCheckpointError(CheckpointError):
    """The checkpoint's files do not match what its save recorded, or cannot be parsed."""


class StateDictMismatchError(CheckpointError):
    """The checkpoint holds a different model: keys are missing, unexpected or differ in shape."""


ERROR_TYPES: dict[str, type[CheckpointError]] = {"CheckpointError": CheckpointError}
ERROR_TYPES.update((cls.__name__, cls) for cls in CheckpointError.__subclasses__())
