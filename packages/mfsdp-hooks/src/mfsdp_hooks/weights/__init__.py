"""The weight side: parameter groups and their storage, shard cuts, weight freshness after an
optimizer step, meta-device init, and the lookups from a parameter to its group."""
