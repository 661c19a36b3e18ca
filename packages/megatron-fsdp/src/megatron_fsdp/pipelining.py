"""Pipeline parallelism over megatron-fsdp stages: ``megatron_fsdp.pipelining.PipelineStage``
is the engine's ``mfsdp_hooks.PipelineStage`` (torch's ``PipelineStage`` without FSDP2's
private state; see ``mfsdp_hooks.api.pipelining``), under the name users import."""

from mfsdp_hooks import PipelineStage, sharded_roots

__all__ = ["PipelineStage", "sharded_roots"]
