"""Bridges to other training frameworks (``accelerate``, ``transformers``), each an optional
import of its own: ``import megatron_fsdp`` imports none (the ``hf`` extra brings them).
"""
