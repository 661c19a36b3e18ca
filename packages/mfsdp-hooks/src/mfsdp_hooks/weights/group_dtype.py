"""A parameter group's storage rebuilt in another dtype (``model.to(torch.float64)`` after
sharding; the checks and the choice of dtypes are ``api.dtype_conversion``'s).

[Note: a dtype conversion of a group] FSDP2 converts each sharded parameter in place
(``nn.Module._apply`` swaps it, ``reset_sharded_param`` re-points its padding). Ours are views
into flat buffers of one dtype, so the group gets new buffers, built as at wrap time for the
new dtypes, and:

* the optimizer-facing values (each distributed parameter's local rows) are copied, converted,
  into the new buffers: each rank converts its own shard, nothing is gathered;
* each distributed parameter takes its new DTensor's contents with ``torch.utils.swap_tensors``
  (its ``__dict__`` kept): the same object, so an optimizer built before still steps it;
* each unsharded parameter is pointed at the new unsharded buffer with ``.data =`` (what
  ``nn.Module._apply`` does to a plain parameter): the same object, with its gradient hook;
* the compute weights are marked stale: the next unshard rebuilds them from the optimizer-
  facing shards (a gather, or under HFSDP the refresh across ``dp_outer``), as after a load;
* the gradient shard and the reducer take the new gradient and reduce dtypes (no gradient is
  held or waiting: the caller checked).
"""

from __future__ import annotations

import torch

from mfsdp_hooks.dtensor.dtensor_views import local_tensor
from mfsdp_hooks.weights.group_storage import weight_buffers
from mfsdp_hooks.weights.param_group import ParameterGroup

__all__ = ["convert_group_dtype"]


def convert_group_dtype(
    group: ParameterGroup,
    *,
    original: torch.dtype,
    compute: torch.dtype,
    optimizer: torch.dtype,
    reduce: torch.dtype,
) -> None:
    """Rebuild ``group``'s buffers for weights that are now ``original`` (the user's dtype),
    computed in ``compute``, stepped in ``optimizer`` and reduced in ``reduce`` (see the
    module note). The group is resharded, holds no gradient and has no codec or TP spec."""
    model, main = weight_buffers(
        group.cuts,
        group.strategy,
        group.names[0],
        compute_dtype=compute,
        optimizer_dtype=optimizer,
        offload=group.offload,
    )
    facing = main if main is not None else model
    replacements = group.cuts.dist_params(facing, group.strategy, originals=group.dist_params)
    with torch.no_grad():
        for old, new in zip(group.dist_params, replacements, strict=True):
            local_tensor(new).copy_(local_tensor(old))
    for old, new in zip(group.dist_params, replacements, strict=True):
        kept = old.__dict__
        torch.utils.swap_tensors(old, new)  # type: ignore[no-untyped-call]
        old.__dict__, new.__dict__ = kept, old.__dict__  # the tags and user attributes stay
    model.materialize()
    for index, param in enumerate(group.unsharded_params):
        param.data = model.unsharded_view(index)
    if model.sharded:
        model.release()
    group.model, group.main = model, main
    group.original_dtype, group.compute_dtype, group.wrap_reduce_dtype = original, compute, reduce
    if group.grads is not None:
        group.grads.dtype = optimizer
    if group.reducer is not None:
        group.reducer.set_reduce_dtype(reduce)
    group.freshness.mark_dirty()
