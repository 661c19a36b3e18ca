"""Collectives carried other than by a plain c10d op: user comms in FSDP2's protocol
(``custom_comms``) and the block-quantized ones (``quantized``, ``quantized_comms`` and their
codec, buffers, error log and exact positions)."""
