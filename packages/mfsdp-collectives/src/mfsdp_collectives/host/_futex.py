"""Block on a 32-bit word in shared memory until another process changes it (Linux futex).

The shared-memory transport waits for its peers once per step; spinning or sleeping in short
slices costs the compute threads CPU and adds latency on a small box. A futex puts the
waiting thread to sleep in the kernel and the publisher wakes it with one system call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Callable
from typing import cast

__all__ = ["available", "wait", "wake"]

_SYS_FUTEX_X86_64 = 202
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall() -> Callable[..., int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    fn = getattr(libc, "syscall", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_long
    return cast("Callable[..., int]", fn)


_syscall = _load_syscall()


def available() -> bool:
    """Whether futex system calls can be made from here (Linux with a C library)."""
    return _syscall is not None


def wait(word: ctypes.c_int32, expected: int, timeout_s: float) -> None:
    """Sleep while ``word`` still holds ``expected``, at most ``timeout_s`` (spurious wakes ok)."""
    assert _syscall is not None
    seconds = int(timeout_s)
    spec = _Timespec(seconds, int((timeout_s - seconds) * 1e9))
    rc = _syscall(
        _SYS_FUTEX_X86_64,
        ctypes.byref(word),
        _FUTEX_WAIT,
        ctypes.c_int32(expected),
        ctypes.byref(spec),
        None,
        0,
    )
    if rc != 0:
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT):
            raise OSError(err, f"futex wait failed: {os.strerror(err)}")


def wake(word: ctypes.c_int32) -> None:
    """Wake every thread (of any process) sleeping on ``word``."""
    assert _syscall is not None
    _syscall(_SYS_FUTEX_X86_64, ctypes.byref(word), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
