"""What a planning run on torch's fake process group and fake tensors needs from this layer
(``megatron_fsdp.plan_memory``, issue 52). Two things differ from a real run:

* a fake tensor has no memory (every ``data_ptr`` is 0): an overlap check must not read it
  (:func:`is_fake`);
* object collectives and the device mesh's setup call ``.item()``, which a fake tensor cannot
  answer: they run on real tensors (:func:`real_tensors`); under :class:`RealMeshesFakeMode`
  torch's own mesh code keeps its rank tables real too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

__all__ = ["RealMeshesFakeMode", "is_fake", "is_fake_group", "real_tensors"]


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is one of ``FakeTensorMode``'s (it holds no memory)."""
    return isinstance(tensor, FakeTensor)


def real_tensors() -> AbstractContextManager[Any]:
    """Real tensors inside, even under ``FakeTensorMode`` (a no-op outside it)."""
    return unset_fake_temporarily()


def is_fake_group(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` belongs to torch's fake process group (a planning run): its peers
    report nothing, so what a rank would learn from them is worked out locally."""
    return str(dist.get_backend(group)).lower() == "fake"


class RealMeshesFakeMode(FakeTensorMode):  # type: ignore[no-untyped-call]
    """``FakeTensorMode`` for an op that touches a fake or floating-point tensor or makes a
    new one; an op of real integer tensors alone runs for real: the rank tables of device
    meshes (made, concatenated, flattened, read with ``.tolist()``), which a fake copy would
    make unreadable. Whatever training computes stays fake."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        if func is not _DEVICE and _all_real_integers(args, kwargs):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


_DEVICE = torch.ops.prim.device.default  # autograd asks it of every tensor: keep it cheap


def _all_real_integers(args: Sequence[object], kwargs: Mapping[str, object]) -> bool:
    """Whether the op has tensors, all real and none floating (a mesh's rank table)."""
    found = False
    for value in (*args, *kwargs.values()):
        for leaf in value if isinstance(value, list | tuple) else (value,):
            if isinstance(leaf, torch.Tensor):
                if isinstance(leaf, FakeTensor) or leaf.is_floating_point():
                    return False
                found = True
    return found
