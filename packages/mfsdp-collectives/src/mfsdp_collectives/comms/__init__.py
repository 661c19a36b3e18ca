"""Collectives carried other than by a plain c10d op: user comms in FSDP2's protocol and
the block-quantized ones."""
