"""The chief's view of its members: the round's phases, a member's record, the model's arena,
and what a ready report must show."""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from collective import logs
from collective._proto import collective_pb2 as pb
from collective.digest import array_digest, one_pass, worker_digest
from collective.model import ModelSource, VariableSpec, check_fits, validate_model
from collective.plan import (
    differing_chunk,
    layout,
    overlapping,
)
from collective.sources.mapped import MappedFiles
from collective.variables import replica_name

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    JOINING = "joining"
    BROADCASTING = "broadcasting"
    STARTED = "started"
    FAILED = "failed"


@dataclass
class Member:
    rank: int
    worker_id: str
    incarnation: str
    host: str
    devices: list[str]
    peer: str
    pid: int
    phase: str = "joined"
    bytes_sent: int = 0
    worker_digest: str = ""
    prepared: bool = False
    told: bool = False
    joined_at: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    relay_port: int = 0
    relay_cert: bytes = b""  # server-only TLS: the certificate its relay serves
    bytes_reported: int = 0  # what its heartbeats say it holds, from whichever sender
    lost_at: float = 0.0  # phase "lost": when, and why (collective.chief.rejoin)
    lost_reason: str = ""

    def received(self) -> int:
        """Bytes of the arena this worker holds: what the chief sent it, or what its heartbeats
        report (a relay-fed worker gets nothing from the chief)."""
        return max(self.bytes_sent, self.bytes_reported)

    def relay_address(self) -> str:
        """Where this worker relays: the address it connected from, with its relay port."""
        if not self.relay_port:
            return ""
        kind, _, rest = self.peer.partition(":")
        host = rest.rpartition(":")[0] if kind in ("ipv4", "ipv6") else ""
        return f"{host}:{self.relay_port}" if host else ""

    def name(self) -> str:
        return f"worker {logs.printable(self.worker_id)} (rank {self.rank}, host {logs.printable(self.host)})"

    def replica_names(self, variable: str) -> list[str]:
        return [replica_name(variable, i) for i in range(len(self.devices))]


class _ChiefReplicas(Member):
    """The chief's own replicas when the chief trains too: checked as a worker's are, but never
    a member of the plan (no rank among the workers, no stream, no heartbeat)."""

    def name(self) -> str:
        return f"the chief's own replicas (training rank 0, host {self.host})"


def materialize(
    source: ModelSource, allocate=lambda n: np.zeros(n, dtype=np.uint8), *, max_bytes: int | None = None
) -> tuple[list[VariableSpec], np.ndarray, list[str]]:
    """Fill every initial value straight into one arena; return specs, arena and digests.

    ``allocate(nbytes)`` makes the arena (a memfd mapping for the shared-memory path). Callable
    and seeded initializers run here, on the chief only. Before anything is allocated, raises
    ModelError for invalid variables and for an arena larger than ``max_bytes`` or than the
    memory available (``collective.model.check_fits``).
    """
    specs = source.specs()
    validate_model(specs, label=source.description)
    offsets, total = layout(specs)
    check_fits(specs, total, label=source.description, max_bytes=max_bytes)
    arena = allocate(total)
    digests = []
    for spec, off in zip(specs, offsets, strict=True):
        view = arena[off : off + spec.nbytes].view(spec.np_dtype).reshape(spec.shape)
        source.fill(spec, view)
        digests.append(array_digest(view))
    return specs, arena, digests


@dataclass
class FileArena:
    """A model served straight from its files: the files mapped read-only (``files.array`` is
    the arena), the variables in the files' order at the files' offsets, their digests and the
    arena's chunk digests for each chunk size the plan may use."""

    files: MappedFiles
    specs: list[VariableSpec]
    offsets: list[int]
    chunk_sizes: set[int]
    digests: list[str] | None = None  # once hashed
    chunk_digests: dict[int, list[str]] = field(default_factory=dict)

    def hash(self) -> None:
        """Read the files once: every variable's digest and the chunk digests for each chunk
        size, each block's pages dropped from this process once hashed. Raises ModelError naming
        a file that changes meanwhile."""
        mapped = self.files
        ranges = [(o, o + s.nbytes) for s, o in zip(self.specs, self.offsets, strict=True)]
        digests, self.chunk_digests = one_pass(mapped.array, ranges, self.chunk_sizes,
                                               before=mapped.check, after=mapped.drop)
        mapped.check()
        self.digests = digests


def map_files(source: ModelSource, chunk_sizes, *, max_bytes: int | None = None) -> FileArena | None:
    """The arena as the model's own files, mapped read-only, not yet read (``FileArena.hash``);
    or None, logged, when the model has no files to serve from (a spec, .npz) or a tensor is not
    aligned in its file to its item size (then ``materialize`` copies it into memory, aligned).

    Raises ModelError as ``materialize`` does (invalid variables, ``max_bytes``; not the memory
    available: nothing is copied), and naming the file when one cannot be mapped."""
    if not hasattr(source, "data_files"):
        return None
    validate_model(source.specs(), label=source.description)
    files, tensors = source.data_files()
    for spec, i, offset in tensors:
        if offset % spec.np_dtype.itemsize:
            log.info("%s: tensor %r is at byte %d of the file, not a multiple of its %d-byte items: "
                     "the model is copied into memory, aligned, instead of served from the file",
                     files[i].label, spec.name, offset, spec.np_dtype.itemsize)
            return None
    mapped = MappedFiles(files)
    specs = [spec for spec, _, _ in tensors]
    offsets = [mapped.starts[i] + offset - files[i].data_start for _, i, offset in tensors]
    # The files are not copied: the chief needs no memory for them (the page cache holds them).
    check_fits(specs, mapped.nbytes, label=source.description, max_bytes=max_bytes, available=None)
    return FileArena(mapped, specs, offsets, set(chunk_sizes))


def report_problem(plan: pb.Plan, m: Member, req: pb.ReadyRequest) -> str | None:
    """The first difference between a member's ready report and the plan, or None.

    Every replica arena (one per device) must have the plan's chunk digests. A chunk that
    differs is named by the variables it holds: one variable's replica exactly, several as
    the range of their names.
    """
    want = list(plan.chunk_digests)
    if [(d.replica, d.device) for d in req.devices] != list(enumerate(m.devices)):
        return (
            f"ready report covers devices {[d.device for d in req.devices]}; "
            f"the worker joined with {list(m.devices)}"
        )
    for d in req.devices:
        got = list(d.chunk_digests)
        differs = differing_chunk(plan, got, want)
        if differs is None:
            continue
        if len(got) != len(want):
            return f"replicas on {d.device}: {len(got)} chunk digests, the plan has {len(want)}"
        start, end = differs
        k = start // plan.chunk_bytes
        names = [v.name for v in overlapping(plan, start, end)]
        if len(names) == 1:
            what = f"variable {names[0]!r}: replica {replica_name(names[0], d.replica)!r}"
        elif names:
            what = (f"one of the {len(names)} variables {names[0]!r}..{names[-1]!r}: replicas "
                    f"{replica_name(names[0], d.replica)!r}..{replica_name(names[-1], d.replica)!r}")
        else:
            what = "padding between variables"
        return (f"{what} on {d.device}: bytes {start}..{end} have digest {got[k]}, "
                f"the chief's are {want[k]}")
    expected = worker_digest(plan.manifest_digest, [want] * len(m.devices))
    if req.worker_digest != expected:
        return f"worker digest {req.worker_digest} differs from the chief's {expected}"
    return None
