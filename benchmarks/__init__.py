"""Side-by-side benchmarks of megatron-fsdp against ``torch.distributed.fsdp.fully_shard``.

Entry point: ``python benchmarks/run.py`` (or ``nox -s bench``); see ``README.md``.
"""
