"""The Megatron-Core adapter reads the config's strategies as ``fully_shard_model`` reads them
(``parse_strategy``, ``parse_outer_strategy``), not by its own string comparisons: once it
took ``"NO_SHARD"`` (which the engine reads as ZeRO-0) for a sharded strategy and went
looking for Megatron-Core's layer classes. Local checks, no process group."""

from __future__ import annotations

import pytest
from mcore_stand_ins import MCoreDDPConfigStandIn

from megatron_fsdp.hybrid import names_hfsdp, parse_outer_strategy
from megatron_fsdp.mcore import _default_units


@pytest.mark.parametrize("strategy", ["no_shard", "NO_SHARD", " no_shard ", 0])
def test_the_adapter_takes_no_units_for_every_spelling_of_no_shard(strategy: object) -> None:
    config = MCoreDDPConfigStandIn(data_parallel_sharding_strategy=strategy)  # type: ignore[arg-type]
    assert _default_units(None, config) == []  # type: ignore[arg-type]


def test_the_adapter_names_the_config_field_of_a_strategy_it_cannot_read() -> None:
    config = MCoreDDPConfigStandIn(data_parallel_sharding_strategy="zero9")
    with pytest.raises(ValueError, match=r"ddp_config\.data_parallel_sharding_strategy='zero9'"):
        _default_units(None, config)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, 1, "optim", "no_shard"])
def test_hfsdp_is_read_as_parse_outer_strategy_reads_it(value: object) -> None:
    assert names_hfsdp(value) == (parse_outer_strategy(value, 3) == "optim")


@pytest.mark.parametrize("value", [True, "OPTIM", 2, None])
def test_a_value_parse_outer_strategy_refuses_is_not_hfsdp(value: object) -> None:
    assert not names_hfsdp(value)
    with pytest.raises(ValueError, match="outer_dp_sharding_strategy="):
        parse_outer_strategy(value, 3)
