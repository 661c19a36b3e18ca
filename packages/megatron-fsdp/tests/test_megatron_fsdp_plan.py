"""``plan_model_states``: the model-state bytes of every rank, planned with no process group
from a meta-device model, must equal what the engine holds on that rank once the model is
really sharded (``describe()`` after one AdamW step), category by category, for ZeRO-0..3,
fp32 and bf16 compute, at 2 and 4 ranks. The model has odd shapes (padding), a frozen
parameter and a tied one, so packing, ownership and per-rank rows all have to match.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp import MixedPrecisionPolicy, fully_shard_model, fully_shard_optimizer
from megatron_fsdp.plan import MODEL_STATE_CATEGORIES, plan_memory, plan_model_states
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing.moe import MOE_WIDTH, MoEBlock, moe_model
from mfsdp_hooks.testing.tp import TP_WIDTH, MLPBlock, megatron_tp_model, tp_model


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(13, 29)
        self.down = nn.Linear(29, 13)
        self.gate = nn.Parameter(torch.ones(7), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x))) * self.gate.sum() / 7


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 13)
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.head = nn.Linear(13, 37, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, owned by the root

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def _policy(bf16: bool) -> MixedPrecisionPolicy | None:
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None


CASES = {2: [(0, False), (1, False), (2, False), (3, False)], 4: [(3, True), (1, True), (2, False)]}


def _engine(rank: int, world: int) -> list[dict[str, int]]:
    held = []
    for strategy, bf16 in CASES[world]:
        torch.manual_seed(0)
        model = fully_shard_model(
            Net(), [Block], zero_dp_strategy=strategy, mixed_precision_policy=_policy(bf16)
        )
        optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        model(torch.randint(0, 37, (2, 5))).float().sum().backward()
        optimizer.step()
        totals = model.describe_sharding(optimizer).totals()
        held.append({c: totals[c] for c in MODEL_STATE_CATEGORIES})
    return held


@pytest.mark.parametrize("world", [2, 4])
def test_the_plan_is_what_each_rank_holds(world: int) -> None:
    ranks = run_distributed(_engine, world, timeout=90)
    with torch.device("meta"):
        meta = Net()
    for case, (strategy, bf16) in enumerate(CASES[world]):
        plan = plan_model_states(
            meta,
            world_size=world,
            fsdp_unit_modules=[Block],
            zero_dp_strategy=strategy,
            mixed_precision_policy=_policy(bf16),
            optimizer="adamw",
        )
        for rank in range(world):
            assert plan.per_rank[rank] == ranks[rank][case], (strategy, bf16, rank)
        assert plan.categories == max(plan.per_rank, key=lambda sizes: sum(sizes.values()))
        assert "ZeRO-" in str(plan) and plan.between_steps_bytes == sum(plan.categories.values())


def test_a_large_world_is_planned_from_meta_without_memory() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(8)))
    plan = plan_model_states(model, world_size=1024, fsdp_unit_modules=[nn.Linear])
    numel = sum(p.numel() for p in model.parameters())
    assert len(plan.per_rank) == 1024
    # fp32 ZeRO-3 + AdamW: weights, gradients, two moments, each a 1/1024 shard of whole
    # rows: a shard of a 4096-wide layer is a multiple of 4096 elements, so each of the 8
    # units pads by at most 1024 rows in all (FlatLayout's bound).
    lower, padding = 16 * numel / 1024, 16 * 8 * 1024 * 4096 / 1024
    assert lower <= plan.between_steps_bytes <= lower + padding
    assert plan.categories["compute_weights"] == plan.categories["gradients"]


def test_bad_arguments_name_themselves() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        plan_model_states(model, world_size=0)
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        plan_model_states(model, world_size=2, optimizer="lamb")


def _parallel_engine(rank: int, world: int) -> list[tuple[dict[str, int], dict[str, int]]]:
    """(plan of this rank, what it holds) for torch TP, Megatron-style TP and EP, each on 4
    ranks; the plan is made from the model this rank holds before it is sharded."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    experts = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "ep"))
    tp_args = dict(device_mesh=mesh, dp_shard_dim="dp_shard", tp_dim="tp")
    cases = [
        (tp_model("mlp", mesh["tp"]), [MLPBlock], 3, False, tp_args, 2, 1),
        (megatron_tp_model(mesh["tp"]), [MLPBlock], 1, True, tp_args, 2, 1),
        (
            moe_model(experts["ep"].get_group()),
            [MoEBlock],
            3,
            False,
            dict(device_mesh=dense, dp_shard_dim="dp_shard", expt_device_mesh=experts),
            1,
            2,
        ),
    ]
    held = []
    for model, units, strategy, bf16, mesh_args, tp, ep in cases:
        plan = plan_model_states(
            model,
            world_size=world,
            fsdp_unit_modules=units,
            zero_dp_strategy=strategy,
            mixed_precision_policy=_policy(bf16),
            tp_size=tp,
            ep_size=ep,
        )
        sharded = fully_shard_model(
            model,
            units,
            zero_dp_strategy=strategy,
            mixed_precision_policy=_policy(bf16),
            **mesh_args,  # type: ignore[arg-type]
        )
        optimizer = fully_shard_optimizer(torch.optim.AdamW(sharded.parameters(), lr=1e-3))
        x = torch.randn(3, MOE_WIDTH if ep > 1 else TP_WIDTH)
        sharded(x).float().sum().backward()
        optimizer.step()
        totals = sharded.describe_sharding(optimizer).totals()
        dp_rank = rank // tp
        held.append((plan.per_rank[dp_rank], {c: totals[c] for c in MODEL_STATE_CATEGORIES}))
    return held


def test_tensor_and_expert_parallel_plans_are_what_each_rank_holds() -> None:
    for rank, cases in enumerate(run_distributed(_parallel_engine, 4, timeout=120)):
        for case, (planned, held) in enumerate(cases):
            assert planned == held, (rank, case, planned, held)


def _float8_engine(rank: int, world: int) -> list[tuple[dict[str, int], dict[str, int]]]:
    from mfsdp_te.float8_testing import Float8Block, float8_model, float8_step

    held = []
    for strategy in (3, 1):
        model = float8_model()
        plan = plan_model_states(
            model, world_size=world, fsdp_unit_modules=[Float8Block], zero_dp_strategy=strategy
        )
        sharded = fully_shard_model(model, [Float8Block], zero_dp_strategy=strategy)
        optimizer = fully_shard_optimizer(torch.optim.AdamW(sharded.parameters(), lr=1e-2))
        float8_step(sharded, optimizer, 0, world, sharded=True)
        totals = sharded.describe_sharding(optimizer).totals()
        held.append((plan.per_rank[rank], {c: totals[c] for c in MODEL_STATE_CATEGORIES}))
    return held


def test_float8_weights_are_planned_as_they_travel() -> None:
    pytest.importorskip("torchao.float8", reason="torchao is not installed (nox installs it)")
    for rank, cases in enumerate(run_distributed(_float8_engine, 2, timeout=120)):
        for case, (planned, held) in enumerate(cases):
            assert planned == held, (rank, case, planned, held)
    from mfsdp_te.float8_testing import Float8Block, float8_model

    model = float8_model()
    plain = plan_memory(
        float8_model(float8_all_gather=False),
        world_size=2,
        fsdp_unit_modules=[Float8Block],
        device="cpu",
    )
    fp8 = plan_memory(model, world_size=2, fsdp_unit_modules=[Float8Block], device="cpu")
    # The claimed weights gather one byte per element (plus their fp32 main weights).
    gathered = {p.phase: p.categories["gathered_weights"] for p in fp8.phases}
    assert max(gathered.values()) < max(p.categories["gathered_weights"] for p in plain.phases)
    assert any(p.categories["codec_buffers"] for p in fp8.phases)
    with pytest.raises(NotImplementedError, match="torchao float8 weights"):
        plan_memory(
            model,
            world_size=2,
            fsdp_unit_modules=[Float8Block],
            example_inputs=(torch.randn(4, 16),),
        )


def test_frozen_and_tied_parameters_plan_through_a_step() -> None:
    with torch.device("meta"):
        meta = Net()  # a frozen gate in each block, the head tied to the embedding
    tokens = torch.randint(0, 37, (2, 5))
    for inputs in ((tokens,), None):
        plan = plan_memory(
            meta, world_size=2, fsdp_unit_modules=[Block], example_inputs=inputs, device="cpu"
        )
        held = max(p.categories["unreduced_gradients"] for p in plan.phases)
        # A block's trainable weights (13x29 + 29 + 29x13 + 13, fp32) arrive in place,
        # with the one in flight before it and the root's (the tied 37x13 embedding).
        block = (13 * 29 + 29 + 29 * 13 + 13) * 4
        assert block <= held <= 2 * block + 37 * 13 * 4
        assert plan.peak_bytes >= plan.between_steps_bytes
