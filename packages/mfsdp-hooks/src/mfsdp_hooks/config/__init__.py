"""Frozen choices, no communication: unit options, sharding strategy, mixed precision, the
reduce config, expert sharding, the parameter-codec protocol and the gradient allocator."""
