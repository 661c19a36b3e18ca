"""The collectives upper layers call, on flat buffers: all-gather, reduce-scatter,
all-reduce and broadcast (``flat_ops``), coalesced gathers, the uneven all-to-all and the
HSDP/HFSDP two-level reductions (``hsdp_ops``); ``route``: the same ops for an engine that
checked its buffers and groups once, where it built them."""
