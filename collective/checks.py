"""Checks after start: do all ranks still hold the same values? (``collective.check``)

Every rank calls ``check(values)`` at the same training step. Each rank digests its tensors
(xxh3-128 of the bytes, as ``digest.array_digest``; each bound to its name, dtype and shape) and
combines them into one 16-byte digest of the whole mapping, taken in name order. The ranks
exchange only that: an all-gather of 16 bytes (and the step). When every rank holds the same
digest the check returns it. Otherwise they all-gather their per-tensor digests and every rank
works out the same answer from the same table, so every rank raises the same
``DivergenceError``: for each tensor that differs, which ranks differ from the reference value
(the value most ranks hold; on a tie, the one the lowest rank holds, rank 0's when it is among
them), or which ranks lack it, or whose dtype or shape differs. The values never travel.

The exchange (an all-gather of bytes, in rank order) is, first match wins:

* ``exchange=``: any callable ``payload -> [every rank's payload]``;
* ``group=``: an mpi4py communicator, or a ``torch.distributed`` process group;
* ``torch.distributed`` when it is initialized (``all_gather_object`` over its default group);
* mpi4py's ``COMM_WORLD`` under an MPI launcher with more than one rank.

Deadlines: over MPI every exchange first waits in a non-blocking barrier for at most
``timeout`` seconds (``transport.mpi.settle``), then raises a DeadlineError on the ranks that
waited; over torch.distributed the process group's own timeout (``init_process_group(timeout=)``)
bounds the wait (its time-out is a DeadlineError too, any other failure a TransportError); a
caller's ``exchange`` bounds its own.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from collective import logs
from collective._api import ArraysSource
from collective.clusterenv import MPI_VARS
from collective.digest import array_digest, combined_digest
from collective.dtypes import wire
from collective.errors import (
    CollectiveError,
    DeadlineError,
    DivergenceError,
    ProtocolError,
    TransportError,
    UsageError,
)

__all__ = ["check", "Exchange", "tensor_digests", "compare"]

Exchange = Callable[[bytes], Sequence[bytes]]
# (name, dtype as on the wire, shape, hex digest of the bytes): one tensor as the ranks compare it.
Entry = tuple[str, str, tuple[int, ...], str]

DEFAULT_TIMEOUT = 300.0  # seconds a rank waits for the others at a check over MPI
MAX_LISTED = 8  # differences spelled out in the message; the rest are counted
_NO_STEP = -1


def tensor_digests(values: Mapping[str, Any]) -> list[Entry]:
    """Every tensor's entry, in name order (the order the combined digest takes them in)."""
    arrays = ArraysSource(values, label="collective.check").arrays
    return [(name, wire(a.dtype), tuple(int(n) for n in a.shape), array_digest(a))
            for name, a in sorted(arrays.items())]


def _combined(entries: Sequence[Entry]) -> str:
    return combined_digest((name, f"{dtype}|{shape}|{digest}") for name, dtype, shape, digest in entries)


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def _describe(dtype: str, shape: tuple[int, ...]) -> str:
    return f"{dtype} {shape}"


def compare(tables: Sequence[Sequence[Entry]], step: int | None = None) -> DivergenceError | None:
    """The error every rank raises for these per-rank tables (rank r's entries at index r), or
    None when they agree. Pure: every rank computes the same answer from the same tables."""
    held: dict[str, list[tuple[str, tuple[int, ...], str] | None]] = {}
    for rank, entries in enumerate(tables):
        for name, dtype, shape, digest in entries:
            held.setdefault(name, [None] * len(tables))[rank] = (dtype, tuple(shape), digest)
    problems: list[str] = []
    culprits: set[int] = set()
    tensors: list[str] = []
    for name in sorted(held):
        values = held[name]
        counts = Counter(values)
        if len(counts) == 1:
            continue
        # The reference: the value most ranks hold; on a tie, the lowest rank's.
        reference = max(counts, key=lambda v: (counts[v], -values.index(v)))
        agree = [r for r, v in enumerate(values) if v == reference]
        tensors.append(name)
        for value in sorted((v for v in counts if v != reference), key=values.index):
            ranks = [r for r, v in enumerate(values) if v == value]
            culprits.update(ranks)
            if value is None:
                problems.append(f"{name!r} is missing on {_ranks(ranks)} ({_ranks(agree)} hold it)")
            elif reference is None:
                problems.append(f"{name!r} exists only on {_ranks(ranks)} ({_ranks(agree)} lack it)")
            elif value[:2] != reference[:2]:
                problems.append(f"{name!r} is {_describe(*value[:2])} on {_ranks(ranks)}, "
                                f"{_describe(*reference[:2])} on {_ranks(agree)}")
            else:
                problems.append(f"{name!r} on {_ranks(ranks)} differs from {_ranks(agree)}")
    if not problems:
        return None
    where = "" if step is None else f" at step {step}"
    shown = logs.first_of(problems, MAX_LISTED, what="more difference(s)")
    ranks = tuple(sorted(culprits))
    return DivergenceError(
        f"replicas differ{where}: {shown} ({len(tensors)} of {len(held)} tensor(s) differ on {len(tables)} ranks)",
        culprit=_ranks(ranks), phase="check", ranks=ranks, tensors=tuple(tensors),
    )


# --- the exchange: an all-gather of bytes ----------------------------------------------------


def _torch_exchange(dist: Any, group: Any, step: int | None) -> Exchange:
    where = "" if step is None else f" at step {step}"

    def allgather(payload: bytes) -> list[bytes]:
        if dist.get_rank(group) < 0:
            raise UsageError("collective.check: this rank is not a member of the given torch.distributed group")
        out: list[Any] = [None] * dist.get_world_size(group)
        try:
            dist.all_gather_object(out, payload, group=group)
        except RuntimeError as exc:  # gloo / NCCL: a peer gone, or the process group's timeout
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            if "timed out" in first.lower():
                raise DeadlineError(f"collective.check{where}: not every rank of the torch.distributed group "
                                    f"took part within the process group's timeout ({first})", phase="check") from None
            raise TransportError(f"collective.check{where}: the all-gather over torch.distributed failed: {first}",
                                 phase="check") from None
        return out

    return allgather


def _mpi_exchange(comm: Any, timeout: float, step: int | None) -> Exchange:
    from collective.transport.mpi import settle

    what = "collective.check" + ("" if step is None else f" at step {step}")

    def allgather(payload: bytes) -> list[bytes]:
        settle(comm, timeout, what=what, phase="check")
        return comm.allgather(payload)

    return allgather


def _mpi_world() -> Any:
    """mpi4py's COMM_WORLD when this process is one of several MPI ranks, else None."""
    launched = any(os.environ.get(size, "").isdigit() and int(os.environ[size]) > 1 for _, size in MPI_VARS)
    if not launched and "mpi4py.MPI" not in sys.modules:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        raise UsageError("collective.check: this process runs under an MPI launcher but mpi4py is not "
                         "installed: pip install mpi4py, or initialize torch.distributed first") from None
    return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None


def _exchange(exchange: Exchange | None, group: Any, timeout: float, step: int | None) -> Exchange:
    if exchange is not None:
        if not callable(exchange):
            raise UsageError(f"collective.check: exchange must be a callable (an all-gather of bytes), "
                             f"not {type(exchange).__name__}")
        return exchange
    if group is not None and hasattr(group, "allgather") and hasattr(group, "Ibarrier"):
        return _mpi_exchange(group, timeout, step)
    dist = sys.modules.get("torch.distributed")
    torch_ready = dist is not None and dist.is_available() and dist.is_initialized()
    if group is not None:
        if not torch_ready:
            raise UsageError(f"collective.check: group is a {type(group).__name__}, neither an mpi4py "
                             "communicator nor a group of an initialized torch.distributed")
        return _torch_exchange(dist, group, step)
    if torch_ready:
        return _torch_exchange(dist, None, step)
    comm = _mpi_world()
    if comm is not None:
        return _mpi_exchange(comm, timeout, step)
    raise UsageError("collective.check compares this rank's values with the other ranks' but has no way to "
                     "reach them: call torch.distributed.init_process_group first, run under mpiexec with "
                     "mpi4py installed, or pass exchange= (a function that all-gathers bytes)")


def _gather(allgather: Exchange, payload: bytes, what: str) -> list[bytes]:
    out = list(allgather(payload))
    if not out or not all(isinstance(p, bytes | bytearray) for p in out):
        raise ProtocolError(f"collective.check: the exchange returned {type(out).__name__} of "
                            f"{len(out)} item(s) for the {what}, not every rank's bytes", phase="check")
    return [bytes(p) for p in out]


def check(values: Mapping[str, Any], *, step: int | None = None, group: Any = None,
          exchange: Exchange | None = None, timeout: float = DEFAULT_TIMEOUT) -> str:
    """Compare this rank's ``values`` (name -> array) with every other rank's; every rank calls
    it at the same step. Returns the hex digest all ranks share; raises ``DivergenceError`` on
    every rank, naming each differing tensor and rank, when they differ. ``step`` goes into the
    message (and ranks that pass different steps are told so). ``group`` / ``exchange``: see
    the module's docstring; ``timeout``: the wait for the other ranks over MPI (seconds)."""
    if not isinstance(values, Mapping):
        hint = (" (for a torch module: collective.torch.check_module(module))"
                if hasattr(values, "state_dict") else "")
        raise UsageError(f"collective.check takes a mapping of name -> array, not {type(values).__name__}{hint}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise UsageError(f"collective.check: step must be a non-negative integer, not {step!r}")
    if not timeout > 0:
        raise UsageError(f"collective.check: timeout must be greater than 0, not {timeout!r}")
    allgather = _exchange(exchange, group, timeout, step)
    entries = tensor_digests(values)
    digest = _combined(entries)
    own = bytes.fromhex(digest) + struct.pack("<q", _NO_STEP if step is None else step)
    firsts = _gather(allgather, own, "digests")
    if any(len(p) != len(own) for p in firsts):
        raise ProtocolError("collective.check: a rank sent a digest of another size "
                            "(every rank must run the same version of collective)", phase="check")
    steps = [struct.unpack("<q", p[16:])[0] for p in firsts]
    if len(set(steps)) > 1:
        said = ", ".join(f"rank {r}: {'none' if s == _NO_STEP else s}" for r, s in enumerate(steps))
        raise UsageError(f"collective.check was called at different steps ({said}): every rank must call it "
                         "at the same step")
    if len({p[:16] for p in firsts}) == 1:
        return digest
    tables = _gather(allgather, json.dumps(entries).encode(), "per-tensor digests")
    try:
        decoded = [[(n, d, tuple(s), h) for n, d, s, h in json.loads(t)] for t in tables]
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"collective.check: a rank's per-tensor digests are unreadable: {exc}",
                            phase="check") from None
    error = compare(decoded, step)
    if error is None:  # the combined digests differ, so some entry must: the ranks disagree on the rules
        raise CollectiveError("collective.check: the ranks' digests differ but no tensor does "
                              "(every rank must run the same version of collective)", phase="check")
    raise error
