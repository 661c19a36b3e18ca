"""The seed README's arguments are explicit parameters of both entry points (issue 26, item 6).

``engine_options.sharding_options`` is the one list; ``fully_shard_model`` and ``fully_shard``
repeat it so that ``help()``, IDEs and mypy see every argument. These tests keep the three in
step (names, order, kinds, annotations, defaults) and check each argument is passed on.
No process group is needed: nothing here reaches a collective.
"""

from __future__ import annotations

import inspect
import pydoc
from typing import Any

import pytest
import torch
from torch import nn

import megatron_fsdp
from megatron_fsdp import api
from megatron_fsdp.engine_options import sharding_options
from megatron_fsdp.unsupported import NOT_YET

# The one table's fully_shard_model arguments: name -> (default, what it needs).
_NOT_YET = {n: (e.default, e.feature) for n, e in NOT_YET.items() if e.where == "argument"}

# Every argument of fully_shard_model that the seed README documents (its walkthrough call,
# its "Advanced Features" list and the TransformerEngine example).
SEED_ARGUMENTS = (
    "module",
    "fsdp_unit_modules",
    "device_mesh",
    "dp_shard_dim",
    "dp_outer_dim",
    "tp_dim",
    "hybrid_fsdp_group",
    "expt_device_mesh",
    "zero_dp_strategy",
    "outer_dp_sharding_strategy",
    "device",
    "init_model_with_meta_device",
    "grad_reduce_in_fp32",
    "preserve_fp32_weights",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "sync_model_each_microbatch",
    "enable_fine_grained_param_gather",
    "keep_fp8_transpose_cache",
    "nccl_ub",
    "fsdp_manual_registration",
    "disable_symmetric_registration",
    "fsdp_double_buffer",
    "preproc_state_dict_for_dcp_ckpt",
)

# fully_shard_model's own argument: what it does after the engine is built.
MODEL_ONLY = "preproc_state_dict_for_dcp_ckpt"


def _described(function: Any, drop: str | None = None) -> list[tuple[str, Any, Any, Any]]:
    """``(name, kind, default, annotation)`` of each parameter, ``drop`` left out."""
    return [
        (p.name, p.kind, p.default, p.annotation)
        for p in inspect.signature(function).parameters.values()
        if p.name != drop
    ]


def test_fully_shard_model_repeats_sharding_options() -> None:
    assert _described(megatron_fsdp.fully_shard_model, drop=MODEL_ONLY) == _described(
        sharding_options
    )


def test_fully_shard_repeats_fully_shard_model() -> None:
    assert _described(megatron_fsdp.fully_shard, drop="optimizer") == _described(
        megatron_fsdp.fully_shard_model
    )
    assert list(inspect.signature(megatron_fsdp.fully_shard).parameters)[:3] == [
        "module",
        "optimizer",
        "fsdp_unit_modules",
    ]


def test_no_argument_hides_behind_var_keyword() -> None:
    for function in (megatron_fsdp.fully_shard_model, megatron_fsdp.fully_shard, sharding_options):
        kinds = {p.kind for p in inspect.signature(function).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds, function
        assert inspect.Parameter.VAR_POSITIONAL not in kinds, function


def test_every_seed_argument_is_a_parameter() -> None:
    for function in (megatron_fsdp.fully_shard_model, megatron_fsdp.fully_shard):
        parameters = inspect.signature(function).parameters
        missing = [name for name in SEED_ARGUMENTS if name not in parameters]
        assert not missing, (function.__name__, missing)


def test_help_lists_every_seed_argument() -> None:
    for function in (megatron_fsdp.fully_shard_model, megatron_fsdp.fully_shard):
        text = pydoc.render_doc(function, renderer=pydoc.plaintext)
        missing = [name for name in SEED_ARGUMENTS if name not in text]
        assert not missing, (function.__name__, missing)


def test_docstring_describes_every_parameter() -> None:
    doc = inspect.getdoc(megatron_fsdp.fully_shard_model) or ""
    args = doc.split("Args:\n", 1)[1]
    undocumented = [
        name
        for name in inspect.signature(megatron_fsdp.fully_shard_model).parameters
        if f"\n    {name}: " not in f"\n{args}"
    ]
    assert not undocumented, undocumented


def test_not_yet_arguments_are_parameters_with_their_defaults() -> None:
    parameters = inspect.signature(sharding_options).parameters
    for name, (default, _) in _NOT_YET.items():
        assert name in parameters, name
        assert parameters[name].default == default, name


@pytest.mark.parametrize("name", sorted(_NOT_YET))
def test_not_yet_argument_set_raises_naming_it(name: str) -> None:
    default = _NOT_YET[name][0]
    value = True if default is False else object()
    with pytest.raises(NotImplementedError, match=rf"^{name}="):
        megatron_fsdp.fully_shard_model(nn.Linear(2, 2), **{name: value})


@pytest.mark.parametrize("entry", ["fully_shard_model", "fully_shard"])
def test_unknown_keyword_raises_type_error_naming_it(entry: str) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="zero_dp_stratgy"):
        if entry == "fully_shard_model":
            megatron_fsdp.fully_shard_model(model, zero_dp_stratgy=3)  # type: ignore[call-arg]
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            megatron_fsdp.fully_shard(model, optimizer, zero_dp_stratgy=3)  # type: ignore[call-arg]


def _sentinels(function: Any, skip: tuple[str, ...]) -> dict[str, object]:
    """A distinct object for every keyword-only parameter of ``function``."""
    return {
        p.name: object()
        for p in inspect.signature(function).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in skip
    }


def test_fully_shard_model_passes_every_argument_on(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    dcp: list[object] = []

    record = object()

    def fake_sharding_options(module: object, units: object, **kwargs: Any) -> object:
        seen.update(kwargs, module=module, fsdp_unit_modules=units)
        return record

    class FakeWrapper:
        """Stands in for the class: checks it gets the record, and "is" the wrapped model."""

        def __new__(cls, module: object, *, fsdp_unit_modules: object, options: object) -> Any:
            assert options is record
            return cls

    monkeypatch.setattr(api, "sharding_options", fake_sharding_options)
    monkeypatch.setattr(api, "MegatronFSDP", FakeWrapper)
    monkeypatch.setattr(api, "enable_dcp", dcp.append)
    module, units = object(), object()
    given = _sentinels(megatron_fsdp.fully_shard_model, skip=(MODEL_ONLY,))
    megatron_fsdp.fully_shard_model(module, units, **given)  # type: ignore[arg-type]
    assert seen == {**given, "module": module, "fsdp_unit_modules": units}
    assert dcp == [api.MegatronFSDP]  # preproc_state_dict_for_dcp_ckpt=True by default
    megatron_fsdp.fully_shard_model(module, units, preproc_state_dict_for_dcp_ckpt=False)  # type: ignore[arg-type]
    assert dcp == [api.MegatronFSDP]


def test_fully_shard_passes_every_argument_on(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    optimizer_preproc: list[object] = []
    wrapped = object()

    def fake_model(module: object, units: object, **kwargs: Any) -> object:
        seen.update(kwargs, module=module, fsdp_unit_modules=units)
        return wrapped

    def fake_optimizer(optimizer: object, preproc_state_dict_for_dcp_ckpt: object) -> object:
        optimizer_preproc.append(preproc_state_dict_for_dcp_ckpt)
        return optimizer

    monkeypatch.setattr(api, "fully_shard_model", fake_model)
    monkeypatch.setattr(api, "fully_shard_optimizer", fake_optimizer)
    monkeypatch.setattr(api, "_rebind_optimizer", lambda optimizer: None)
    module, units = object(), object()
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    given = _sentinels(megatron_fsdp.fully_shard, skip=())
    result = megatron_fsdp.fully_shard(module, optimizer, units, **given)  # type: ignore[arg-type]
    assert result == (wrapped, optimizer)
    assert seen == {**given, "module": module, "fsdp_unit_modules": units}
    assert optimizer_preproc == [given[MODEL_ONLY]]


def test_the_readme_table_of_refusals_names_every_refused_setting() -> None:
    """The README's "What is refused, and why" lists each entry of the one table (and
    nothing it lists as refused is accepted silently: each name is still in the table or
    refused elsewhere by name)."""
    from pathlib import Path

    readme = (Path(__file__).parents[3] / "README.md").read_text()
    section = readme.split("## What is refused, and why", 1)[1].split("\n## ", 1)[0]
    missing = [name for name in NOT_YET if f"`{name}" not in section]
    assert not missing, f"README's table of refusals lacks {missing}"
