"""Elementwise ops among row-sharded DTensors of one layout run on their local tensors.

Each op is checked against the same op on the whole tensor in one process (through
``full_tensor()``, which gathers the true rows), for an uneven cut and an even one
(``torch.chunk``'s rows); what the shortcut cannot prove local (a dtype
change, another layout, a plain DTensor, a pending ``Partial`` sum) must still come out as
DTensor computes it. Torch's AdamW over such parameters keeps its state in their class and
matches a one-process AdamW exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import RowShardedDTensor, row_sharded
from mfsdp_hooks.dtensor import row_sharded as row_sharded_module
from mfsdp_hooks.dtensor.local_elementwise import NOT_LOCAL

_ROWS, _COLS = 6, 4
_CUTS = {"uneven": ((0, 5), (5, 6)), "even": ((0, 3), (3, 6))}
_Op = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _value(seed: int) -> torch.Tensor:
    return torch.randn(_ROWS, _COLS, generator=torch.Generator().manual_seed(seed))


def _rows(full: torch.Tensor, mesh: DeviceMesh, ranges: tuple[tuple[int, int], ...]) -> DTensor:
    start, end = ranges[mesh.get_local_rank(0)]
    plain = DTensor.from_local(
        full[start:end].clone(),
        mesh,
        [Shard(0), *([Partial()] if mesh.ndim == 2 else [])],
        run_check=False,
        shape=full.shape,
        stride=full.stride(),
    )
    return row_sharded(plain, ranges)


# (name, op): each takes (x, y, z) and may write x only. The shortcut takes _KEEPING (the
# result keeps the row-sharded class and rows) and leaves _DTENSORS_OWN to DTensor.
_KEEPING: list[tuple[str, _Op]] = [
    ("mul_", lambda x, y, z: x.mul_(0.9)),
    ("add_ alpha", lambda x, y, z: x.add_(y, alpha=-0.5)),
    ("lerp_", lambda x, y, z: x.lerp_(y, 0.1)),
    ("addcmul_", lambda x, y, z: x.addcmul_(y, y, value=0.3)),
    ("addcdiv_", lambda x, y, z: x.addcdiv_(y, z.abs() + 1.0, value=-0.1)),
    ("mul_ 0-dim tensor", lambda x, y, z: x.mul_(torch.tensor(0.5))),
    ("clamp_", lambda x, y, z: x.clamp_(min=-0.2)),
    ("fill_", lambda x, y, z: x.fill_(3.0)),
    ("zero_", lambda x, y, z: x.zero_()),
    ("add", lambda x, y, z: x + y),
    ("sqrt div", lambda x, y, z: (y * y).sqrt() / 3.0),
    ("zeros_like", lambda x, y, z: torch.zeros_like(x)),
    ("full_like", lambda x, y, z: torch.full_like(y, 2.0)),
    ("clone", lambda x, y, z: y.clone()),
    ("detach", lambda x, y, z: y.detach()),
    ("nn.Parameter", lambda x, y, z: torch.nn.Parameter(y)),
]
_DTENSORS_OWN: list[tuple[str, _Op]] = [
    ("to float64", lambda x, y, z: y.to(torch.float64)),
    ("zeros_like dtype", lambda x, y, z: torch.zeros_like(y, dtype=torch.float64)),
    ("gt", lambda x, y, z: (y > z).to(torch.float32)),
    ("abs", lambda x, y, z: y.abs()),  # not tagged pointwise
    ("mul_ a plain DTensor", lambda x, y, z: x.mul_(_plain(y))),
]
_IN_PLACE = {"mul_", "add_ alpha", "lerp_", "addcmul_", "addcdiv_", "mul_ 0-dim tensor"}
_IN_PLACE |= {"clamp_", "fill_", "zero_", "mul_ a plain DTensor"}


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """Ours as a plain DTensor over the same local tensor (which the shortcut must leave to
    DTensor); a whole tensor as it is."""
    if not isinstance(tensor, DTensor):
        return tensor
    local, mesh = tensor.to_local(), tensor.device_mesh
    return DTensor.from_local(local, mesh, [Shard(0)], shape=tensor.shape, stride=tensor.stride())


def _check_ops(mesh: DeviceMesh) -> None:
    for cut, ranges in _CUTS.items():
        for name, op in _KEEPING + _DTENSORS_OWN:
            full = [_value(seed) for seed in range(3)]
            ours = [_rows(t, mesh, ranges) for t in full]
            assert type(ours[0]) is RowShardedDTensor, (cut, type(ours[0]).__name__)
            with torch.no_grad():
                want, got = op(*full), op(*ours)
            assert isinstance(got, DTensor), f"{cut} {name}"
            what = f"{cut} {name}"
            torch.testing.assert_close(got.full_tensor(), want, rtol=0, atol=0, msg=what)
            if name in _IN_PLACE:  # the argument written is the one returned, rows and all
                torch.testing.assert_close(ours[0].full_tensor(), full[0], rtol=0, atol=0)
            if (name, op) in _KEEPING:
                assert type(got) is RowShardedDTensor, f"{what}: {type(got).__name__}"
                assert got.dp_row_ranges == ranges, what


def _check_partial_is_left_to_dtensor(rank: int, mesh: DeviceMesh) -> None:
    ours = _rows(_value(0), mesh, _CUTS["uneven"])
    with torch.no_grad():
        rooted = (ours * ours).sqrt()  # not linear: a pending sum must be taken first
    assert not any(placement.is_partial() for placement in rooted.placements), rooted.placements
    start, end = _CUTS["uneven"][rank]  # DTensor's result is a plain one: compare our rows
    torch.testing.assert_close(rooted.to_local(), _value(0).abs()[start:end], rtol=1e-6, atol=0)


def _params(mesh: DeviceMesh | None) -> list[torch.nn.Parameter]:
    """One parameter per cut, whole (``mesh`` None) or row-sharded over ``mesh``."""
    if mesh is None:
        return [torch.nn.Parameter(_value(seed)) for seed in range(len(_CUTS))]
    return [
        torch.nn.Parameter(_rows(_value(seed), mesh, ranges))
        for seed, ranges in enumerate(_CUTS.values())
    ]


def _set_grads(whole: list[Any], ours: list[Any], mesh: DeviceMesh, seed: int) -> None:
    for index, (plain, sharded) in enumerate(zip(whole, ours, strict=True)):
        grad = _value(seed + index)
        plain.grad = grad
        sharded.grad = _rows(grad, mesh, sharded.dp_row_ranges)


@contextlib.contextmanager
def _counting_fallbacks() -> Iterator[list[str]]:
    """The ops the row-sharded tensors hand to DTensor's dispatcher inside the block."""
    seen: list[str] = []
    original = row_sharded_module.run_locally

    def counted(cls: Any, func: Any, *rest: Any) -> Any:
        out = original(cls, func, *rest)
        if out is NOT_LOCAL:
            seen.append(str(func))
        return out

    row_sharded_module.run_locally = counted
    try:
        yield seen
    finally:
        row_sharded_module.run_locally = original


def _check_adamw(mesh: DeviceMesh, *, foreach: bool) -> None:
    whole, ours = _params(None), _params(mesh)
    optimizers = [
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=foreach)
        for params in (whole, ours)
    ]
    with _counting_fallbacks() as fallbacks:
        for step in range(10):
            _set_grads(whole, ours, mesh, 100 + 10 * step)
            for optimizer in optimizers:
                optimizer.step()
    assert fallbacks == [], f"foreach={foreach}: ops left to DTensor: {sorted(set(fallbacks))}"
    for plain, sharded in zip(whole, ours, strict=True):
        torch.testing.assert_close(sharded.full_tensor(), plain.detach(), rtol=0, atol=0)
        for key in ("exp_avg", "exp_avg_sq"):
            state = optimizers[1].state[sharded][key]
            assert type(state) is type(sharded), f"foreach={foreach} {key}: {type(state).__name__}"
            assert state.dp_row_ranges == sharded.dp_row_ranges, key
            want = optimizers[0].state[plain][key]
            torch.testing.assert_close(state.full_tensor(), want, rtol=0, atol=0)


def _check_clip_grad_norm(mesh: DeviceMesh) -> None:
    """The norm is DTensor's (a reduction, left to it); scaling the gradients by the clip
    factor, a replicated 0-dim DTensor, is local and keeps their class."""
    whole, ours = _params(None), _params(mesh)
    _set_grads(whole, ours, mesh, 7)
    for foreach in (False, True):
        want = torch.nn.utils.clip_grad_norm_(whole, 0.5, foreach=foreach)
        norm = torch.nn.utils.clip_grad_norm_(ours, 0.5, foreach=foreach)
        assert isinstance(norm, DTensor)
        torch.testing.assert_close(norm.full_tensor(), want, rtol=1e-6, atol=0)
        for plain, sharded in zip(whole, ours, strict=True):
            assert type(sharded.grad) is type(sharded), type(sharded.grad).__name__
            assert plain.grad is not None and sharded.grad is not None
            torch.testing.assert_close(sharded.grad.full_tensor(), plain.grad, rtol=1e-6, atol=0)


def _worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    _check_ops(mesh)
    _check_adamw(mesh, foreach=False)
    _check_adamw(mesh, foreach=True)
    _check_clip_grad_norm(mesh)
    _check_partial_is_left_to_dtensor(rank, init_device_mesh("cpu", (world, 1)))


def test_elementwise_ops_on_one_layout_run_locally_and_exactly() -> None:
    """Every op equals the whole-tensor op; those proven local keep the class and rows; a
    pending ``Partial`` sum is DTensor's to take. Torch's AdamW keeps its state (``zeros_like``
    of the parameter, then elementwise updates) in the parameter's class, so its steps never
    leave the local path, and matches a one-process AdamW exactly, single-tensor and
    ``foreach``; ``clip_grad_norm_`` equals the whole tensors'."""
    run_distributed(_worker, 2, timeout=90)
