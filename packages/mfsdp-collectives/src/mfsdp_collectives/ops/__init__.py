"""The collectives upper layers call, on flat buffers: all-gather, reduce-scatter,
all-reduce and broadcast (``flat_ops``), coalesced gathers, the uneven all-to-all and the
HSDP/HFSDP two-level reductions (``hsdp_ops``). Each checks its arguments, then issues through
``route`` (``Route``, which an engine holds per group, checked once; its reductions' stages are
``reduce_stages``)."""
