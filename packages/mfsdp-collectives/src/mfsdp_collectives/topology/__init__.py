"""Which groups FSDP shards and replicates over (``fsdp_topology``), the optimizer-facing
shards (``optim_sharding``), the smaller post-forward group and NCCL user buffers."""
