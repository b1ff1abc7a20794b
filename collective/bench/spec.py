"""The bench's inputs: defaults, option parsers, the candidates and the model spec it writes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from collective.errors import CollectiveError, UsageError
from collective.sizes import NUMBER_UNIT as _NUMBER_UNIT
from collective.topology import TOPOLOGIES

GiB = 1 << 30

DEFAULT_WORKERS = "4"
DEFAULT_SIZE = "256MiB"
DEFAULT_VARIABLES = 64
DEFAULT_REPEAT = 3
DEFAULT_RATE = "200mbit"
SPEC_SEED = 7
CHIEF_PORT = 50051
GLOO_PORT = 29500
MAX_EMULATED_WORKERS = 99  # host names worker-1 .. worker-99 (the harness allows 13 characters)


class BenchError(CollectiveError):
    """A benchmark run failed (the message names the configuration and where its logs are)."""


# --- option parsing --------------------------------------------------------------------------

_RATE_UNITS = {  # tc(8) units, in bits per second
    "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "kibit": 1 << 10, "mibit": 1 << 20, "gibit": 1 << 30, "tibit": 1 << 40,
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12,
    "kibps": 8 << 10, "mibps": 8 << 20, "gibps": 8 << 30, "tibps": 8 << 40,
}


def parse_rate(text: str) -> float:
    """A tc rate (``200mbit``, ``1gbit``, ``25mbps`` = bytes/s) -> bits per second."""
    m = _NUMBER_UNIT.match(str(text))
    unit = (m.group(2).lower() or "bit") if m else None
    if m is None or unit not in _RATE_UNITS:
        raise UsageError(f"--rate {text!r}: expected a tc rate such as 200mbit, 1gbit or 25mbps (bytes/s)")
    bits = float(m.group(1)) * _RATE_UNITS[unit]
    if not bits >= 8000:
        raise UsageError(f"--rate {text!r} is too slow to measure anything; use at least 8kbit")
    return bits


def _positive(text: str, option: str) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise UsageError(f"{option} {text!r} is not a whole number") from None
    if value < 1:
        raise UsageError(f"{option} must be at least 1, got {value}")
    return value


def parse_workers(values: Sequence[str] | None, *, option: str = "--workers") -> list[int]:
    """``--workers 2 --workers 4,8`` -> [2, 4, 8] (sorted, no duplicates); ``--hosts`` alike."""
    out: set[int] = set()
    for value in values or [DEFAULT_WORKERS]:
        parts = [p for p in str(value).split(",")]
        if not all(p.strip() for p in parts):
            raise UsageError(f"{option} {value!r}: expected a number or a comma list such as 2,4,8")
        out.update(_positive(p, option) for p in parts)
    return sorted(out)


def parse_list(values: Sequence[str] | None, option: str) -> list[str]:
    """Repeatable, comma-separated option values, in order, without duplicates."""
    out: list[str] = []
    for value in values or []:
        for part in str(value).split(","):
            part = part.strip()
            if not part:
                raise UsageError(f"{option} {value!r}: empty name in the comma list")
            if part not in out:
                out.append(part)
    return out


@dataclass(frozen=True)
class Candidate:
    """One way of the project's to broadcast: a reported name, a transport and a topology to pass."""

    name: str
    transport: str  # grpc | mpi
    topology: str | None = None  # value for --topology, None: pass none


def candidates(transports: Sequence[str], topologies: Sequence[str]) -> list[Candidate]:
    """The project candidates to run: every requested topology (default: every one but
    ``auto``) on gRPC, and ``mpi`` for ``--transport mpi``."""
    out: list[Candidate] = []
    for t in transports:
        if t not in ("grpc", "mpi"):
            raise UsageError(f"--transport {t!r} is not one of grpc, mpi")
    if "grpc" in transports:
        for name in topologies or [c for c in TOPOLOGIES if c != "auto"]:
            if name not in TOPOLOGIES:
                raise UsageError(f"unknown topology {name!r}; use one of: {', '.join(TOPOLOGIES)}")
            out.append(Candidate(name, "grpc", name))
    elif topologies:
        raise UsageError("--topology applies to the grpc transport; add --transport grpc")
    if "mpi" in transports:
        out.append(Candidate("mpi", "mpi"))
    return out


# --- the model ---------------------------------------------------------------------------------


def variable_lengths(size: int, variables: int) -> list[int]:
    """float32 element counts of ``variables`` variables totalling ``size`` bytes; whole 16-element
    (64-byte) blocks first, so no alignment padding appears in the arena when size allows."""
    if size % 4:
        raise UsageError(f"--size {size} is not a multiple of 4: the model is float32 variables")
    elements = size // 4
    if variables > elements:
        raise UsageError(f"--variables {variables} do not fit {size} bytes (at least 4 bytes each)")
    blocks, extra = divmod(elements, 16)
    if blocks >= variables:
        base, rest = divmod(blocks, variables)
        lengths = [16 * (base + (i < rest)) for i in range(variables)]
        lengths[-1] += extra
    else:
        base, rest = divmod(elements, variables)
        lengths = [base + (i < rest) for i in range(variables)]
    assert sum(lengths) * 4 == size and min(lengths) > 0
    return lengths


def write_spec(path: Path, size: int, variables: int, seed: int = SPEC_SEED) -> Path:
    """A YAML initializer spec of float32 variables ``v00000``... totalling ``size`` bytes."""
    width = max(5, len(str(variables - 1)))
    lines = [f"seed: {seed}", "variables:"]
    for i, n in enumerate(variable_lengths(size, variables)):
        lines.append(f"  - {{name: v{i:0{width}d}, shape: [{n}], dtype: float32, initializer: uniform}}")
    path.write_text("\n".join(lines) + "\n")
    return path


# --- peers ----------------------------------------------------------------------------------------


def aligned(rows: list[list[str]]) -> list[str]:
    """The rows (the first one the head) as text columns: the first left-aligned, the others
    right-aligned, a rule under the head."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines
