"""``format_bytes``: the one spelling of a size, in the three forms its readers print (the
wrap-time log, ``describe``'s table and the plans' exact figures; issue 53)."""

from __future__ import annotations

import pytest

from mfsdp_hooks import format_bytes


@pytest.mark.parametrize(
    ("nbytes", "log", "table", "plan"),
    [
        (0, "0 B", "0 B", "0 B"),
        (1023, "1023 B", "1023 B", "1,023 B"),
        (1024, "1.0 KiB", "1.00 KiB", "1.000 KiB (1,024 B)"),
        (1536, "1.5 KiB", "1.50 KiB", "1.500 KiB (1,536 B)"),
        (2**20 - 1, "1024.0 KiB", "1024.00 KiB", "1,023.999 KiB (1,048,575 B)"),
        (1000 * 2**20, "1000.0 MiB", "1000.00 MiB", "1,000.000 MiB (1,048,576,000 B)"),
        (1_478_364_160, "1.4 GiB", "1.38 GiB", "1.377 GiB (1,478,364,160 B)"),
        (3 * 2**40, "3.0 TiB", "3.00 TiB", "3.000 TiB (3,298,534,883,328 B)"),
    ],
)
def test_one_formatter_spells_each_readers_form(
    nbytes: int, log: str, table: str, plan: str
) -> None:
    assert format_bytes(nbytes) == log
    assert format_bytes(nbytes, 2) == table
    assert format_bytes(nbytes, 3, exact=True) == plan
