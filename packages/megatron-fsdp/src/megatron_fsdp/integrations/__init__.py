"""Bridges to other training frameworks, each an optional import of its own.

* ``megatron_fsdp.integrations.accelerate``: ``MegatronFSDPAccelerator``, an ``accelerate``
  ``Accelerator`` that leaves a model sharded by megatron-fsdp alone (no DDP wrap).
* ``megatron_fsdp.integrations.transformers``: ``MegatronFSDPTrainer``, a
  ``transformers.Trainer`` that shards its model with megatron-fsdp and checkpoints it with
  our atomic DCP saves.

Nothing here is imported by ``import megatron_fsdp``: install the extra
(``pip install megatron-fsdp[hf]``) and import the module you need.
"""
