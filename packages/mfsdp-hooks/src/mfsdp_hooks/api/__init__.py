"""What users call: ``fully_shard`` and its wrap-time checks, ``FSDPModule``, the root wrapper
that shards every ``fsdp_unit_modules`` match, and extra forward methods."""
