"""torch's ``DistributedDataParallel`` around a model we sharded: refused as DDP is built.

Our units reduce their own gradients over their own groups and, between steps, hold a shard
of each parameter, so DDP around one would broadcast tensors whose sizes differ by rank (on CPU
it dies in ``_sync_module_states`` with "shape '[2048]' is invalid for input of size 4096") or
reduce every gradient a second time. Hugging Face ``accelerate`` wraps each model it prepares
in DDP whenever it runs several processes without its own FSDP, which is how users meet this.

DDP's constructor asks the module it wraps for ``_ddp_params_and_buffers_to_ignore`` (with
``hasattr``) before its first collective, on every rank; our classes answer with the error
below. It is an attribute of our own classes: nothing of torch's or accelerate's is patched,
and a single-process ``accelerate`` (no DDP) never asks.
"""

from __future__ import annotations

from typing import NoReturn

__all__ = ["RefusesDDP"]


class RefusesDDP:
    """Mixed into the classes of our units and root wrapper."""

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> NoReturn:
        # Not an AttributeError: hasattr() would swallow it and DDP would go on.
        raise TypeError(
            f"DistributedDataParallel({type(self).__name__}): this model is sharded by "
            "megatron-fsdp, which gathers its parameters and reduces its gradients itself; do "
            "not wrap it in DDP, use it as it is. With Hugging Face accelerate, build "
            "megatron_fsdp.integrations.accelerate.MegatronFSDPAccelerator(...) in place of "
            "accelerate.Accelerator(...): its prepare() leaves our models unwrapped"
        )
