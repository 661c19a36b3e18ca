"""What one benchmark run is: the model, the precision, the implementation, the world.

Everything a rank needs travels in one frozen, picklable ``RunSpec``, so a run is
reproducible from its JSON record alone and the parent never shares state with the ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

IMPLS = ("ours", "fsdp2", "local")
"""``ours``: mfsdp_hooks.fully_shard; ``fsdp2``: torch's fully_shard; ``local``: the same
per-rank computation with no communication (the overlap-efficiency reference)."""

PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class ModelConfig:
    """A GPT-like transformer and the per-rank batch it trains on."""

    name: str
    width: int
    depth: int
    heads: int
    seq: int
    batch: int
    """Sequences per rank per step (the same on every implementation)."""
    vocab: int = 256

    @property
    def tokens_per_rank(self) -> int:
        return self.batch * self.seq

    def params(self) -> int:
        """Parameter count: blocks (attention + 4x MLP + 2 norms), embeddings, final norm, head."""
        w = self.width
        block = (3 * w * w + 3 * w) + (w * w + w) + (4 * w * w + 4 * w) + (4 * w * w + w) + 4 * w
        return self.depth * block + self.vocab * w + self.seq * w + 2 * w + w * self.vocab

    def describe(self) -> str:
        return (
            f"w{self.width} d{self.depth} h{self.heads} seq{self.seq} b{self.batch} "
            f"({self.params() / 1e6:.1f}M params, {self.tokens_per_rank} tok/rank)"
        )


# Sized for a 2-core CPU with one torch thread per rank (README.md, "Sizing"): at world
# size 2, default takes about a second per fp32 step (9.9M parameters, 1024 tokens per
# rank); comm moves 14.6M parameters (58 MB in fp32 per gather) for 64 tokens per rank;
# compute runs a 1.1M-parameter model on 2048 tokens per rank with 512-token attention.
CONFIGS: dict[str, ModelConfig] = {
    "default": ModelConfig("default", width=512, depth=3, heads=8, seq=256, batch=4),
    "comm": ModelConfig("comm", width=768, depth=2, heads=12, seq=32, batch=2),
    "compute": ModelConfig("compute", width=192, depth=2, heads=4, seq=512, batch=4),
    # Many small units: 32 blocks of 0.2M parameters, 64 tokens per rank; each unit's
    # collectives are latency-bound (the case --merge-blocks is for).
    "small": ModelConfig("small", width=128, depth=32, heads=2, seq=32, batch=2),
}

QUICK_CONFIGS: dict[str, ModelConfig] = {
    "default": ModelConfig("default", width=64, depth=2, heads=2, seq=32, batch=2),
    "comm": ModelConfig("comm", width=128, depth=2, heads=2, seq=8, batch=1),
    "compute": ModelConfig("compute", width=32, depth=2, heads=2, seq=64, batch=4),
    "small": ModelConfig("small", width=32, depth=8, heads=2, seq=8, batch=1),
}


@dataclass(frozen=True)
class RunSpec:
    """One process world: one implementation on one model, precision and world size."""

    impl: str
    model: ModelConfig
    precision: str
    world_size: int
    warmup: int
    steps: int
    device_type: str = "cpu"
    instrument: bool = False
    """Run construction and one extra step under the memory tracker and collective counter
    (untimed); the timed steps always run without any instrumentation."""
    instrument_warmup: int = 2
    profile_dir: str | None = None
    """When set, profile ``steps`` steps with torch.profiler instead of timing them."""
    seed: int = 0
    grad_allocator: str = "plain"
    """Ours only: the allocator of the temporary gradient reduce buffers."""
    host_transport: str = "auto"
    """Ours only, CPU: shared-memory collectives or gloo's."""
    backward_prefetch_grad_fraction: float = 0.5
    """Ours only: share of a unit's gradient that arrives before it prefetches the next."""
    contiguous_step: bool = True
    """Ours only: AdamW steps contiguous runs of the sharded buffers, not each parameter."""
    prefetch_depth: int = 1
    """Ours only: units gathered ahead in forward and backward."""
    merge_blocks: int = 0
    """Ours only: N > 0 gathers N blocks ahead as one all-gather (``prefetch_numel`` of N
    blocks' elements with ``coalesce_prefetch``, the reference's
    ``suggested_communication_unit_size``); 0: ``prefetch_depth`` units, one at a time."""
    hsdp_outer: int = 1
    """Replicas across ``dp_outer`` (both implementations): 1 is plain FSDP over every rank;
    N > 1 is HSDP on an (N, world_size / N) mesh, FSDP2's ``fully_shard(mesh=2-D)``."""
    outer_optim: bool = False
    """Ours only, with ``hsdp_outer > 1``: HFSDP (optimizer state cut across dp_outer too)."""
    tp: int = 1
    """Tensor parallelism (both implementations): the blocks' MLPs are cut over ``tp`` ranks
    with torch's DTensor TP, FSDP shards over the ``world_size / tp`` DP ranks."""
    float8: bool = False
    """torchao float8 training of the blocks' Linear layers with float8 all-gather (both
    implementations; FSDP2 with torchao's recommended per-step scale precompute)."""
    quantize_comms: str = "none"
    """Ours only: ``grads`` (int8 block-quantized reduce-scatters) or ``grads+weights`` (and
    all-gathers), through ``mfsdp_hooks.quantize_communication``."""
    serial_reductions: bool = False
    """Ours only, shared-memory transport: reduce-scatters queued behind the all-gathers on
    one worker (the transport before its second lane), to measure what concurrency gives."""
    reshard_after_forward: int = 0
    """Both implementations: N > 1 keeps each block's weights sharded over N consecutive ranks
    between forward and backward (FSDP2's ``reshard_after_forward=N``), so backward gathers
    among them; 0: the default (blocks reshard over every rank)."""

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.hsdp_outer < 1 or self.world_size % self.hsdp_outer:
            raise ValueError(
                f"hsdp_outer={self.hsdp_outer} must be >= 1 and divide world_size={self.world_size}"
            )
        if self.tp < 1 or self.world_size % self.tp or (self.tp > 1 and self.hsdp_outer > 1):
            raise ValueError(
                f"tp={self.tp} must be >= 1 and divide world_size={self.world_size}, and "
                "TP runs without --hsdp-outer"
            )
        if self.tp > 1 and self.impl == "local":
            raise ValueError("tp > 1 compares FSDP implementations: pass --impls ours fsdp2")
        if self.float8 and (self.precision != "fp32" or self.impl == "local" or self.tp > 1):
            raise ValueError("float8 compares FSDP implementations in fp32 without TP")
        if self.outer_optim and self.hsdp_outer == 1:
            raise ValueError("outer_optim (HFSDP) needs hsdp_outer > 1: pass --hsdp-outer N")
        if self.reshard_after_forward < 0:
            raise ValueError(
                f"reshard_after_forward must be >= 0, got {self.reshard_after_forward}"
            )
        if self.merge_blocks < 0:
            raise ValueError(f"merge_blocks must be >= 0, got {self.merge_blocks}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"need steps >= 1 and warmup >= 0, got {self.steps}, {self.warmup}")

    def data_rank(self, rank: int) -> int:
        """Which batch a rank trains on: the TP ranks of one DP rank share it."""
        return rank // self.tp

    def replace(self, **changes: object) -> RunSpec:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def label(self) -> str:
        return f"{self.model.name}/{self.precision}/ws{self.world_size}/{self.impl}"
