"""The live-tensor tracker: allocation, views, storage resize, late frees and phase peaks."""

from __future__ import annotations

import gc

import torch

from mfsdp_buffers import LiveTensorTracker

KB = 4 * 1024  # bytes of 1024 fp32 elements


def test_alloc_view_free() -> None:
    with LiveTensorTracker() as mem:
        a = torch.empty(1024)
        view = a.view(32, 32)[1:]
        assert mem.live == KB
        b = torch.ones(1024, dtype=torch.bfloat16)
        assert mem.live == KB + KB // 2
        del a
        assert mem.live == KB + KB // 2  # the view keeps the storage alive
        del view
        gc.collect()
        assert mem.live == KB // 2
        del b
    assert mem.live == 0
    assert mem.peak == KB + KB // 2


def test_storage_resize_counts_as_free_and_regrow() -> None:
    with LiveTensorTracker() as mem:
        t = torch.zeros(1024)
        t.untyped_storage().resize_(0)
        assert mem.live == 0
        t.untyped_storage().resize_(KB)
        assert mem.live == KB
        mem.mark("regrown")
        t.untyped_storage().resize_(0)
        mark = mem.mark("freed")
    assert (mark.live, mark.peak) == (0, KB)
    assert mem.marks[0].live == KB
    del t
    assert mem.live == 0


def test_frees_after_exit_are_still_counted() -> None:
    with LiveTensorTracker() as mem:
        t = torch.empty(2048)
    assert mem.live == 2 * KB
    del t
    assert mem.live == 0


def test_autograd_temporaries_and_phase_peaks() -> None:
    with LiveTensorTracker() as mem:
        w = torch.randn(256, 256, requires_grad=True)
        x = torch.randn(64, 256)
        base = mem.live
        mem.reset_phase()
        loss = (x @ w).relu().sum()
        fwd = mem.mark("forward")
        loss.backward()  # type: ignore[no-untyped-call]
        bwd = mem.mark("backward")
    assert fwd.live > base  # saved activations
    assert w.grad is not None
    assert bwd.live >= base + w.grad.numel() * 4
    assert bwd.peak >= bwd.live


def test_a_fake_run_is_counted() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        weight = torch.empty(64, 32)  # made before the tracker: never counted, views included
        tracker = LiveTensorTracker(fake=True)
        with tracker:
            tracker.ignore([weight])
            x = torch.ones(8, 64)
            out = x @ weight  # 8x32 fp32, and no copy of the weight's storage (a view: .t())
            mark = tracker.mark("phase")
            del out, x
    assert mark.live == 8 * 64 * 4 + 8 * 32 * 4
    assert tracker.live == 0  # the fake storages were released as they died
