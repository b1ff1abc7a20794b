"""Byte counts written by people: one parser and one formatter for every flag, message and table.

``parse_size("256MiB")``, ``parse_size("64MB")``, ``parse_size("4096")``; ``format_bytes(n)``
gives ``3.6 TiB`` (binary units, one decimal; exact below 1 KiB). Nothing here imports the
rest of the package: every layer may use it.
"""

from __future__ import annotations

import re

from collective.errors import UsageError

SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
NUMBER_UNIT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str, *, option: str = "--size") -> int:
    """``256MiB``, ``1MiB``, ``20000KiB``, ``1.5GiB``, ``64MB`` (10^6) or plain bytes -> bytes.
    Single letters (``K``, ``M``, ``G``) are binary, like ``dd``. UsageError naming ``option``."""
    m = NUMBER_UNIT.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in SIZE_UNITS:
        raise UsageError(f"{option} {text!r}: expected bytes, optionally with a unit (KiB, MiB, GiB, KB, MB, GB), e.g. 256MiB")
    value = float(m.group(1)) * SIZE_UNITS[unit]
    if value != int(value):
        raise UsageError(f"{option} {text!r} is not a whole number of bytes")
    if value < 1:
        raise UsageError(f"{option} must be at least 1 byte, got {text!r}")
    return int(value)


def format_bytes(n: int) -> str:
    """``3.6 TiB``: binary units, one decimal; exact below 1 KiB."""
    if n < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"):
        value /= 1024
        if value < 1024 or unit == "YiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")
