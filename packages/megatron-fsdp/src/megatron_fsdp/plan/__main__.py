"""``python -m megatron_fsdp.plan --help``."""

from megatron_fsdp.plan.cli import main

main()
