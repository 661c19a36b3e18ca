"""FSDP2's ``fully_shard`` options, side by side with torch's FSDP2 on the same CPU ranks.

``ignored_params`` are left alone by both (not sharded, gradients not reduced: each rank
trains them on its own batch); the losses, the ignored parameters' values and the
``state_dict`` keys and shapes agree. Options the engine does not have yet raise naming them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hooks_models import (
    VOCAB,
    WIDTH,
    Block,
    local_slice,
    loss_fn,
    make_batches,
    make_model,
    shard_blocks,
    train_data_parallel,
)
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import ShardingStrategy, fully_shard

STEPS = 5


def _assert_same_losses(ours: list[float], theirs: list[float]) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, theirs)


def _ignored_worker(rank: int, world: int, impl: str) -> dict[str, Any]:
    model = make_model()
    ignored = {model.blocks[0].fc1.weight, model.blocks[1].norm.bias}  # type: ignore[index]
    shard_blocks(model, impl, ignored_params=ignored)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = train_data_parallel(model, optimizer, make_batches(STEPS), rank, world)
    state = model.state_dict()
    return {
        "losses": losses,
        "ignored": [p.detach().tolist() for p in sorted(ignored, key=lambda p: p.numel())],
        "ignored_are_plain": all(type(p) is nn.Parameter for p in ignored),
        "keys": {k: tuple(v.shape) for k, v in state.items()},
    }


def test_ignored_params_are_left_alone_as_fsdp2_leaves_them() -> None:
    ours = run_distributed(_ignored_worker, 2, "ours", timeout=120)
    torch_fsdp2 = run_distributed(_ignored_worker, 2, "fsdp2", timeout=120)
    for mine, theirs in zip(ours, torch_fsdp2, strict=True):
        assert mine["ignored_are_plain"] and theirs["ignored_are_plain"]
        _assert_same_losses(mine["losses"], theirs["losses"])
        for a, b in zip(mine["ignored"], theirs["ignored"], strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)
        assert mine["keys"] == theirs["keys"]
    # Not reduced: each rank trained the ignored parameters on its own batch.
    assert ours[0]["ignored"][1] != ours[1]["ignored"][1]


def _policy_worker(rank: int, world: int, impl: str) -> list[float]:
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy

    model = make_model()
    shard_blocks(model, impl, mp_policy=FSDP2Policy(param_dtype=torch.bfloat16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    tokens, _ = make_batches(1)[0]
    assert model(local_slice(tokens, rank, world))[0].dtype == torch.bfloat16  # the policy's
    return train_data_parallel(model, optimizer, make_batches(STEPS), rank, world)


def test_torch_fsdp2_mixed_precision_policy_is_taken_as_it_is() -> None:
    ours = run_distributed(_policy_worker, 2, "ours", timeout=120)
    torch_fsdp2 = run_distributed(_policy_worker, 2, "fsdp2", timeout=120)
    for mine, theirs in zip(ours, torch_fsdp2, strict=True):
        for a, b in zip(mine, theirs, strict=True):  # bf16 compute: bf16 tolerance
            assert abs(a - b) <= 1e-2 * abs(b), (mine, theirs)


def _option_worker(rank: int, world: int, option: str) -> str:
    model = make_model()
    if option == "nested_modules":
        try:
            fully_shard([model, model.blocks[1]])  # type: ignore[index]
        except ValueError as error:
            return f"{type(error).__name__}: {error}"
        return "accepted"
    options: dict[str, Any] = {
        "ignored_params": {"ignored_params": ["fc1.weight"]},
        "offload_policy": {"offload_policy": object()},
    }[option]
    try:
        fully_shard(model, **options)
    except (NotImplementedError, ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("ignored_params", "TypeError: ignored_params[0] is a str, not a parameter"),
        ("offload_policy", "TypeError: offload_policy must be torch.distributed.fsdp"),
        ("nested_modules", "ValueError: module: Block is inside ToyModel"),
    ],
)
def test_options_the_engine_lacks_raise_naming_them(option: str, expected: str) -> None:
    for message in run_distributed(_option_worker, 2, option, timeout=60):
        assert message.startswith(expected), message


class _Scorer(nn.Module):
    """``score`` reads the weight without going through ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x)
        return out

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.lin.weight.t()).sum(dim=-1)


def _forward_method_worker(rank: int, world: int, impl: str) -> dict[str, Any]:
    from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

    from mfsdp_hooks import register_fsdp_forward_method

    torch.manual_seed(0)
    model = nn.Sequential(_Scorer(), nn.Linear(8, 4))
    x = torch.randn(3, 8)
    want = model[0].score(x).tolist()
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        torch_fully_shard(model[0])
        torch_fully_shard(model)
        torch_register(model[0], "score")
    else:
        fully_shard(model[0])
        fully_shard(model)
        register_fsdp_forward_method(model[0], "score")
    model(x)  # the root's first forward sets the units up
    got = model[0].score(x).tolist()
    return {"got": got, "want": want, "resharded": isinstance(model[0].lin.weight, DTensor)}


def test_a_registered_forward_method_sees_the_whole_weights_as_in_fsdp2() -> None:
    ours = run_distributed(_forward_method_worker, 2, "ours", timeout=120)
    torch_fsdp2 = run_distributed(_forward_method_worker, 2, "fsdp2", timeout=120)
    for mine, theirs in zip(ours, torch_fsdp2, strict=True):
        torch.testing.assert_close(torch.tensor(mine["got"]), torch.tensor(mine["want"]))
        torch.testing.assert_close(torch.tensor(mine["got"]), torch.tensor(theirs["got"]))
        assert mine["resharded"] and theirs["resharded"]


def _setter_worker(rank: int, world: int, impl: str, setter: str) -> dict[str, Any]:
    """Train with one of FSDP2's runtime setters; report losses and parameter states.

    "keep_after_backward" is FSDP2's gradient accumulation recipe: each step is two
    micro-batches, the first without gradient sync and without resharding after backward
    (so the second needs no all-gather), the second with both.
    """
    model: Any = make_model()
    shard_blocks(model, impl)
    if setter == "reshard_root":
        model.set_reshard_after_forward(True)
    micro = 2 if setter == "keep_after_backward" else 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    states: dict[str, list[bool]] = {"after_forward": [], "after_backward": []}
    losses = []
    for tokens, targets in make_batches(STEPS):
        pairs = zip(
            local_slice(tokens, rank, world).chunk(micro),
            local_slice(targets, rank, world).chunk(micro),
            strict=True,
        )
        for index, (x, y) in enumerate(pairs):
            last = index == micro - 1
            if micro > 1:
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
            out = model(x)
            states["after_forward"].append(isinstance(model.embed.weight, DTensor))
            loss = loss_fn(out, y) / micro
            loss.backward()
            states["after_backward"].append(isinstance(model.blocks[0].fc1.weight, DTensor))
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, **states}


@pytest.mark.parametrize("setter", ["reshard_root", "keep_after_backward"])
def test_runtime_setters_train_as_fsdp2_does(setter: str) -> None:
    ours = run_distributed(_setter_worker, 2, "ours", setter, timeout=120)
    torch_fsdp2 = run_distributed(_setter_worker, 2, "fsdp2", setter, timeout=120)
    for mine, theirs in zip(ours, torch_fsdp2, strict=True):
        _assert_same_losses(mine["losses"], theirs["losses"])
        assert mine["after_forward"] == theirs["after_forward"], setter
        assert mine["after_backward"] == theirs["after_backward"], setter
    # The default root keeps its weights after forward; reshard_root shards them.
    micro = 2 if setter == "keep_after_backward" else 1
    assert ours[0]["after_forward"] == [setter == "reshard_root"] * STEPS * micro
    # Accumulating, the first micro-batch keeps the weights gathered, the last reshards.
    assert ours[0]["after_backward"] == [True, False][:micro][::-1] * STEPS


def _divide_factor_worker(rank: int, world: int) -> list[float]:
    from hooks_models import train_single_process, trainable

    model: Any = make_model()
    shard_blocks(model, "ours")
    for unit in [*model.blocks, model]:
        unit.set_gradient_divide_factor(1.0)  # a sum over the ranks, not their mean
    optimizer = torch.optim.SGD(trainable(model), lr=5e-2, momentum=0.9)
    batches = make_batches(STEPS)
    got = train_data_parallel(model, optimizer, batches, rank, world, global_mean=True)
    # The sum of the ranks' mean gradients is world x the global mean: one process with SGD
    # at world x the learning rate. (FSDP2 needs NCCL's PREMUL_SUM for this; gloo has none.)
    reference = make_model()
    ref_opt = torch.optim.SGD(trainable(reference), lr=5e-2 * world, momentum=0.9)
    want = train_single_process(reference, ref_opt, batches)
    return [abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)]


def test_a_gradient_divide_factor_replaces_the_mean() -> None:
    for errors in run_distributed(_divide_factor_worker, 2, timeout=120):
        assert max(errors) <= 1e-5, errors


def test_setters_ours_lacks_raise_naming_them() -> None:
    from mfsdp_hooks import FSDPModule

    model: Any = make_model()
    assert isinstance(model, nn.Module)
    with pytest.raises(NotImplementedError, match="set_post_optim_event"):
        # object.__new__: torch's FSDPModule.__new__ builds the original module class.
        object.__new__(FSDPModule).set_post_optim_event(object())  # type: ignore[arg-type]


def _offload_worker(rank: int, world: int, impl: str) -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy

    model = make_model()
    shard_blocks(model, impl, offload_policy=CPUOffloadPolicy(pin_memory=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    batches = make_batches(STEPS)
    losses = train_data_parallel(model, optimizer, batches[:-1], rank, world)
    tokens, targets = (local_slice(t, rank, world) for t in batches[-1])
    loss_fn(model(tokens), targets).backward()  # leaves gradients to look at
    on_host = [p.to_local().device.type == "cpu" for p in model.parameters()]
    on_host += [
        p.grad.to_local().device.type == "cpu" for p in model.parameters() if p.grad is not None
    ]
    on_host += [t.device.type == "cpu" for s in optimizer.state.values() for t in s.values()]
    state = model.state_dict()
    return {
        "losses": losses,
        "on_host": all(on_host),
        "keys": {k: tuple(v.shape) for k, v in state.items()},
    }


def test_cpu_offload_policy_keeps_the_state_on_the_host_as_fsdp2() -> None:
    ours = run_distributed(_offload_worker, 2, "ours", timeout=120)
    torch_fsdp2 = run_distributed(_offload_worker, 2, "fsdp2", timeout=120)
    for mine, theirs in zip(ours, torch_fsdp2, strict=True):
        _assert_same_losses(mine["losses"], theirs["losses"])
        assert mine["on_host"] and theirs["on_host"]
        assert mine["keys"] == theirs["keys"]


def test_cpu_offload_on_cpu_moves_nothing_and_a_bad_policy_is_refused() -> None:
    # From an accelerator it offloads (test_hooks_offload, with the host copies forced).
    from types import SimpleNamespace

    from torch.distributed.fsdp import CPUOffloadPolicy

    from mfsdp_hooks.api.fsdp2_options import check_offload_policy

    on_cpu: Any = SimpleNamespace(device=torch.device("cpu"), shards_optimizer_across_outer=False)
    zero3 = ShardingStrategy.OPTIM_GRADS_PARAMS
    assert check_offload_policy(CPUOffloadPolicy(), on_cpu, zero3) is None  # there already
    with pytest.raises(TypeError, match="offload_policy must be"):
        check_offload_policy("cpu", on_cpu, zero3)


class _TiedLM(nn.Module):
    """Tied input embedding and output head, the case ``fully_shard([a, b])`` is for."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _module_list_worker(rank: int, world: int, impl: str) -> dict[str, Any]:
    model = _TiedLM()
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard as shard
    else:
        shard = fully_shard
    for block in model.blocks:
        shard(block)
    returned = shard([model.embed, model.head])
    shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses, after_forward = [], []
    for tokens, targets in make_batches(STEPS):
        logits = model(local_slice(tokens, rank, world))
        after_forward.append(isinstance(model.embed.weight, DTensor))
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), local_slice(targets, rank, world).reshape(-1)
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = model.state_dict()
    return {
        "losses": losses,
        "after_forward": after_forward,
        "returned_list": returned == [model.embed, model.head],
        "tied": model.head.weight is model.embed.weight,
        "keys": {k: tuple(v.shape) for k, v in state.items()},
        "embed": state["embed.weight"].full_tensor().tolist(),
    }


def test_one_unit_over_several_modules_as_fsdp2_for_tied_embeddings() -> None:
    ours = run_distributed(_module_list_worker, 2, "ours", timeout=120)
    torch_fsdp2 = run_distributed(_module_list_worker, 2, "fsdp2", timeout=120)
    for mine, theirs in zip(ours, torch_fsdp2, strict=True):
        _assert_same_losses(mine["losses"], theirs["losses"])
        assert mine["after_forward"] == theirs["after_forward"] == [True] * STEPS
        assert mine["returned_list"] and theirs["returned_list"]
        assert mine["tied"] and theirs["tied"]
        assert mine["keys"] == theirs["keys"]
        torch.testing.assert_close(torch.tensor(mine["embed"]), torch.tensor(theirs["embed"]))


def _placement_worker(rank: int, world: int, impl: str) -> dict[str, Any]:
    from torch.distributed.tensor import Shard

    model = make_model()
    shard_blocks(
        model, impl, shard_placement_fn=lambda param: Shard(0) if param.dim() > 1 else None
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = train_data_parallel(model, optimizer, make_batches(STEPS), rank, world)
    return {"losses": losses, "keys": {k: tuple(v.shape) for k, v in model.state_dict().items()}}


def test_shard_placement_fn_on_dim_0_trains_as_fsdp2() -> None:
    ours = run_distributed(_placement_worker, 2, "ours", timeout=120)
    torch_fsdp2 = run_distributed(_placement_worker, 2, "fsdp2", timeout=120)
    for mine, theirs in zip(ours, torch_fsdp2, strict=True):
        _assert_same_losses(mine["losses"], theirs["losses"])
        assert mine["keys"] == theirs["keys"]


def test_shard_placement_fn_answers_are_checked_naming_the_parameter() -> None:
    from torch.distributed.tensor import Replicate, Shard

    from mfsdp_hooks.api.fsdp2_options import check_shard_placements
    from mfsdp_hooks.runtime.slots import collect_slots

    slots = collect_slots(make_model())
    assert check_shard_placements(lambda p: None, slots) == ()  # FSDP2's default: dim 0
    dims = check_shard_placements(lambda p: Shard(-1) if p.dim() > 1 else Shard(0), slots)
    assert ("embed.weight", 1) in dims and ("blocks.0.fc1.weight", 1) in dims
    assert all(dim == 1 for _, dim in dims) and len(dims) == 9
    with pytest.raises(ValueError, match=r"Shard\(dim=2\) for 'embed.weight' of shape \(11, 15\)"):
        check_shard_placements(lambda p: Shard(2) if p.dim() > 1 else None, slots)
    with pytest.raises(ValueError, match=r"Replicate\(\) for 'embed.weight'"):
        check_shard_placements(lambda p: Replicate(), slots)
    with pytest.raises(NotImplementedError, match=r"'embed.weight', a codec-claimed parameter"):
        check_shard_placements(lambda p: Shard(1), slots, lambda p: p.dim() > 1)
    with pytest.raises(TypeError, match="shard_placement_fn must be callable"):
        check_shard_placements(Shard(0), slots)  # type: ignore[arg-type]


def _all_reduce_later_worker(rank: int, world: int, impl: str) -> dict[str, Any]:
    """FSDP2's HSDP accumulation recipe on a 2x2 mesh: the first micro-batch of each step
    under set_requires_all_reduce(False), the second with True."""
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp_collectives import CommTracer

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    model: Any = make_model()
    shard_blocks(model, impl, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses, outer_calls = [], []
    for tokens, targets in make_batches(STEPS, global_batch=16):
        pairs = zip(
            local_slice(tokens, rank, world).chunk(2),
            local_slice(targets, rank, world).chunk(2),
            strict=True,
        )
        with CommTracer() as tracer:
            for index, (x, y) in enumerate(pairs):
                model.set_requires_all_reduce(index == 1)
                loss = loss_fn(model(x), y) / 2
                loss.backward()
                losses.append(loss.item())
        outer_calls.append(tracer.calls("all_reduce"))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "outer_calls": outer_calls}


def test_set_requires_all_reduce_defers_the_replica_all_reduce_as_fsdp2() -> None:
    ours = run_distributed(_all_reduce_later_worker, 4, "ours", timeout=240)
    torch_fsdp2 = run_distributed(_all_reduce_later_worker, 4, "fsdp2", timeout=240)
    for mine, theirs in zip(ours, torch_fsdp2, strict=True):
        _assert_same_losses(mine["losses"], theirs["losses"])
        # Once per step for each of the 4 trainable groups (3 blocks and the root), after
        # the second micro-batch; the first one's shards waited for it.
        assert mine["outer_calls"] == [4] * STEPS, mine["outer_calls"]
