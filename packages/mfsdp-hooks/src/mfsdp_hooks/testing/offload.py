"""Host offload under test: the copies it made, on CPU with the copies forced
(``forced_host_copies()``, ``config.offload``), summed over the model's units."""

from __future__ import annotations

from torch import nn

from mfsdp_hooks.api.fully_shard import fsdp_units
from mfsdp_hooks.config.offload import CopyCounts, HostOffload, forced_host_copies

__all__ = ["forced_host_copies", "offloads", "offload_counts", "reset_offload_counts"]


def offloads(model: nn.Module) -> list[HostOffload]:
    """Each distinct ``HostOffload`` of the model's units once, in unit order."""
    found: dict[int, HostOffload] = {}
    for unit in fsdp_units(model):
        offload = unit.options.offload
        if offload is not None:
            found.setdefault(id(offload), offload)
    return list(found.values())


def offload_counts(model: nn.Module) -> CopyCounts:
    """The copies every unit of ``model`` made since wrapping (or the last reset)."""
    total = CopyCounts()
    for offload in offloads(model):
        counts = offload.counts
        total.to_device += counts.to_device
        total.to_device_bytes += counts.to_device_bytes
        total.to_host += counts.to_host
        total.to_host_bytes += counts.to_host_bytes
    return total


def reset_offload_counts(model: nn.Module) -> None:
    for offload in offloads(model):
        offload.counts.reset()
