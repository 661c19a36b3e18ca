"""Live and peak tensor bytes on any device, for memory tests and benchmarks.

The accelerator allocators keep peak statistics; the CPU has none, and the resident-set size mixes
tensors with the Python heap, gloo's buffers and freed-but-cached pages. This tracker counts
tensor storages only, the same way for both FSDP implementations:

* allocation: a ``TorchDispatchMode`` sees every aten op's outputs (forward, autograd backward,
  optimizer, collectives' outputs) and registers each storage it has not seen, with its bytes.
  Tensor subclasses (DTensor) are unwrapped into their inner tensors, because a mode sees
  DTensor ops before DTensor unwraps them.
* release: a ``weakref.finalize`` on the storage object. torch preserves a storage's Python
  object for as long as the C++ storage lives, so the finalizer fires exactly when the bytes
  are returned.
* resize: both FSDP2 and megatron-fsdp free unsharded parameters with
  ``untyped_storage().resize_(0)`` while the tensor (and storage) stays alive. That call does
  not go through the dispatcher, so ``UntypedStorage.resize_`` is wrapped while a tracker is
  open and the storage's bytes are re-read after every resize.

Host and device: given the compute ``device``, the tracker counts the storages on the host
(``residence``: a CPU storage while an accelerator computes, host offload's buffers, what an
op made from host storages alone) apart, in ``host_live``/``host_peak``; ``live``, ``peak``
and the marks' sites then count the device alone.

Blind spots (the same for both implementations): temporaries that C++ kernels allocate
internally (e.g. inside gloo collectives) and storages created before the tracker opened.
Open it before building the model.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from mfsdp_buffers import residence

__all__ = ["LiveTensorTracker", "PhaseMark", "SiteNamer"]

SiteNamer = Callable[[str, str], str]
"""``(file path, function name) -> site``: how an attributing tracker names where a storage
was made (a planner sorts them into its categories this way)."""

_DEVICE_OF = torch.ops.prim.device.default
_patch_lock = threading.Lock()
_open_trackers: list[LiveTensorTracker] = []
_original_resize: Callable[..., Any] | None = None


@dataclass(frozen=True)
class PhaseMark:
    """Live bytes at the end of a phase and the peak reached during it.

    ``peak_by_site``: at the moment of that peak, live bytes per allocation site (the
    innermost Python frame outside torch's core that created the storage), when the tracker
    attributes; autograd's own outputs show up under the frame that called ``backward()``.
    """

    name: str
    live: int
    peak: int
    peak_by_site: dict[str, int] | None = None
    host_live: int = 0
    """Host bytes at the end of the phase (a tracker given the compute ``device``)."""
    host_peak: int = 0
    """The host's peak during the phase."""


_SKIP_PARTS = (
    "/torch/",
    "live_memory.py",
    "/contextlib.py",
    "/functools.py",
)
_KEEP_PARTS = ("/torch/distributed/fsdp/", "/torch/optim/", "/torch/nn/modules/")


def _allocation_site(skip: tuple[str, ...], name_site: SiteNamer | None) -> str:
    """``dir/file.py:function`` of the innermost frame that is not torch plumbing, or what
    ``name_site`` calls that frame's file and function."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if any(k in path for k in _KEEP_PARTS) or not any(k in path for k in skip):
            if name_site is not None:
                return name_site(path, frame.f_code.co_name)
            parts = path.replace("\\", "/").split("/")
            return f"{'/'.join(parts[-2:])}:{frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def _tracked_resize(storage: torch.UntypedStorage, size: int) -> Any:
    assert _original_resize is not None
    result = _original_resize(storage, size)
    for tracker in list(_open_trackers):
        tracker._observe_storage(storage)
    return result


def _install_resize_patch(tracker: LiveTensorTracker) -> None:
    global _original_resize
    with _patch_lock:
        if not _open_trackers:
            _original_resize = torch.UntypedStorage.resize_
            torch.UntypedStorage.resize_ = _tracked_resize  # type: ignore[method-assign,assignment]
        _open_trackers.append(tracker)


def _remove_resize_patch(tracker: LiveTensorTracker) -> None:
    global _original_resize
    with _patch_lock:
        _open_trackers.remove(tracker)
        if not _open_trackers and _original_resize is not None:
            torch.UntypedStorage.resize_ = _original_resize  # type: ignore[method-assign]
            _original_resize = None


def _plain_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor with real storage in ``obj``, looking inside wrapper subclasses."""
    leaves, _ = tree_flatten(obj)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(leaf):
            names, _ = leaf.__tensor_flatten__()
            yield from _plain_tensors([getattr(leaf, name) for name in names])
        elif leaf.device.type != "meta":
            yield leaf


class LiveTensorTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts live storage bytes; ``peak`` is the high-water mark since open or ``mark``.

    Usage::

        with LiveTensorTracker() as mem:
            model = build()          # storages made here are counted
            ...
            mem.mark("forward")      # live bytes now, peak since the previous mark

    Finalizers stay registered after the ``with`` block, so bytes freed later are still
    subtracted and the tracker can be re-entered with a consistent count.
    """

    def __init__(
        self,
        attribute: bool = False,
        skip_sites: Sequence[str] = (),
        *,
        fake: bool = False,
        name_site: SiteNamer | None = None,
        granularity: int = 1,
        device: torch.device | str | None = None,
    ) -> None:
        """``attribute``: record allocation sites; ``skip_sites``: more file-name parts to look
        past when attributing (e.g. another dispatch mode stacked on this one); ``fake``:
        count meta storages too, which back ``FakeTensorMode``'s tensors, to measure a run
        that allocates nothing (open the tracker inside the fake mode); ``name_site``: how
        sites are named (default ``dir/file.py:function``); ``granularity``: count each
        storage rounded up to a multiple of this many bytes (CUDA's caching allocator hands
        out 512-byte blocks, and ``max_memory_allocated`` counts the blocks; the device's
        storages only); ``device``: the compute device, to count what lives on the host
        apart (module docstring)."""
        super().__init__()  # type: ignore[no-untyped-call]
        if isinstance(granularity, bool) or not isinstance(granularity, int) or granularity < 1:
            raise ValueError(f"granularity={granularity!r}: give a positive int of bytes")
        self.attribute = attribute
        self._name_site = name_site
        self._granularity = granularity
        self._count_meta = fake
        # Held, so that their ids stay theirs.
        self._ignored: dict[int, torch.UntypedStorage] = {}
        self._skip = _SKIP_PARTS + tuple(skip_sites)
        self._lock = threading.RLock()  # a finalizer may fire while we hold it (GC)
        self._sizes: dict[int, int] = {}
        self._site_of: dict[int, str] = {}
        self._by_site: dict[str, int] = {}
        self._phase_peak_by_site: dict[str, int] = {}
        self.live = 0
        self.peak = 0
        """Highest ``live`` since the tracker opened (never reset)."""
        self.phase_peak = 0
        """Highest ``live`` since the last ``mark`` (or ``reset_phase``)."""
        self.marks: list[PhaseMark] = []
        self.device = None if device is None else torch.device(device)
        self._host_keys: set[int] = set()
        self.host_live = 0
        """Live bytes on the host (with ``device`` given; 0 otherwise)."""
        self.host_peak = 0
        """Highest ``host_live`` since the tracker opened."""
        self.phase_host_peak = 0

    # ------------------------------------------------------------------ mode protocol
    def __enter__(self) -> LiveTensorTracker:
        _install_resize_patch(self)
        if self.device is not None:
            residence.listen(self._moved_to_host)
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        super().__exit__(exc_type, exc, tb)  # type: ignore[no-untyped-call]
        if self.device is not None:
            residence.unlisten(self._moved_to_host)
        _remove_resize_patch(self)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is _DEVICE_OF:  # allocates nothing; autograd asks it of every fake tensor
            device: torch.device = args[0].device
            return device
        out = func(*args, **(kwargs or {}))
        inputs = (args, kwargs)
        if isinstance(out, torch.Tensor) and not is_traceable_wrapper_subclass(out):
            if out.device.type != "meta":  # most ops: one tensor, no pytree walk
                self._observe_storage(out.untyped_storage(), inputs, out)
        elif isinstance(out, torch.Tensor | list | tuple | dict):  # not a device, size, None
            for tensor in _plain_tensors(out):
                self._observe_storage(tensor.untyped_storage(), inputs, tensor)
        return out

    def ignore(self, tensors: Sequence[torch.Tensor]) -> None:
        """Never count these tensors' storages, even when an op returns a view of them: a
        storage made before the tracker opened (a parameter) is otherwise counted the first
        time a view of it (``weight.t()``) passes by."""
        with self._lock:
            for tensor in _plain_tensors(list(tensors)):
                storage = tensor.untyped_storage()
                self._ignored[id(storage)] = storage

    # ------------------------------------------------------------------ accounting
    def _observe_storage(
        self,
        storage: torch.UntypedStorage,
        inputs: Any = None,
        tensor: torch.Tensor | None = None,
    ) -> None:
        if storage.device.type == "meta" and not self._count_meta:
            return
        if self._ignored.get(id(storage)) is storage:
            return
        key = id(storage)
        with self._lock:
            old = self._sizes.get(key)
            if old is None:
                weakref.finalize(storage, self._release, key)
                if self.attribute:
                    self._site_of[key] = _allocation_site(self._skip, self._name_site)
                if self.device is not None and self._made_on_host(storage, tensor, inputs):
                    self._host_keys.add(key)
                old = 0
            nbytes = self._bytes(storage, key in self._host_keys)
            if old == nbytes:
                return
            self._sizes[key] = nbytes
            self._add(nbytes - old, self._site_of.get(key), key in self._host_keys)

    def _made_on_host(
        self, storage: torch.UntypedStorage, tensor: torch.Tensor | None, inputs: Any
    ) -> bool:
        """Whether a new storage is on the host (``residence``): a CPU storage while an
        accelerator computes, one made as host memory, or one an op made from host storages
        alone (the optimizer's state and temporaries, made like its host parameters)."""
        assert self.device is not None
        if tensor is not None and residence.on_host(tensor, self.device):
            return True
        if residence.marked_host(storage):
            return True
        keys = self._host_keys
        if not keys or inputs is None:  # nothing on the host yet (no offload): nothing to walk
            return False
        read = [id(t.untyped_storage()) for t in _plain_tensors(list(inputs))]
        return bool(read) and all(key in keys for key in read)

    def _bytes(self, storage: torch.UntypedStorage, host: bool) -> int:
        if host:  # the granularity is the device allocator's
            return int(storage.nbytes())
        return -(-storage.nbytes() // self._granularity) * self._granularity

    def _moved_to_host(self, storage: torch.UntypedStorage) -> None:
        """A storage counted on the device was marked host memory (``residence``)."""
        key = id(storage)
        with self._lock:
            if key in self._host_keys or self._ignored.get(key) is storage:
                return
            old = self._sizes.get(key)
            self._host_keys.add(key)
            if old is None:
                return
            self._add(-old, self._site_of.get(key), False)
            self._sizes[key] = self._bytes(storage, True)
            self._add(self._sizes[key], self._site_of.get(key), True)

    def _release(self, key: int) -> None:
        with self._lock:
            nbytes = self._sizes.pop(key, 0)
            host = key in self._host_keys
            self._host_keys.discard(key)
            self._add(-nbytes, self._site_of.pop(key, None), host)

    def _add(self, delta: int, site: str | None, host: bool = False) -> None:
        if host:
            self.host_live += delta
            self.host_peak = max(self.host_peak, self.host_live)
            self.phase_host_peak = max(self.phase_host_peak, self.host_live)
            return
        self.live += delta
        if site is not None:
            self._by_site[site] = self._by_site.get(site, 0) + delta
        if self.live > self.peak:
            self.peak = self.live
        if self.live > self.phase_peak:
            self.phase_peak = self.live
            if self.attribute:
                self._phase_peak_by_site = {k: v for k, v in self._by_site.items() if v}

    # ------------------------------------------------------------------ phases
    def reset_phase(self) -> None:
        """Start a new phase window: its peak starts from the bytes live now."""
        with self._lock:
            self.phase_peak = self.live
            self.phase_host_peak = self.host_live
            self._phase_peak_by_site = {k: v for k, v in self._by_site.items() if v}

    def mark(self, name: str) -> PhaseMark:
        """Close the current phase: record live bytes and the phase's peak, start the next."""
        with self._lock:
            by_site = dict(self._phase_peak_by_site) if self.attribute else None
            mark = PhaseMark(
                name, self.live, self.phase_peak, by_site, self.host_live, self.phase_host_peak
            )
            self.marks.append(mark)
            self.reset_phase()
        return mark
