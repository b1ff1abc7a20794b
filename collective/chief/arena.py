"""Where the chief's bytes live, and nothing else: the model materialized into memory, into a
sealed shared-memory memfd (``shm``), or its files mapped read-only (``from_file``); with shards,
each training rank's own arena copied out of it. ``ChiefArena`` builds one, answers each rank's
plan, chunker and byte count, hands it to same-host workers (``transport.shm.ShmServer``), checks
and hashes the files, and closes. The round's state and lock are ``ChiefService``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from collective._proto import collective_pb2 as pb
from collective.arena import SharedArena
from collective.digest import bytes_digest, one_pass
from collective.errors import ModelError
from collective.model import ModelSource, VariableSpec, check_fits, validate_model
from collective.plan import Chunker, build_plan, layout
from collective.shards import ShardedArenas
from collective.sources.mapped import MappedFiles
from collective.topology import TOPOLOGIES, chunk_bytes_for

log = logging.getLogger(__name__)


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
        raw = arena[off : off + spec.nbytes]
        source.fill(spec, raw.view(spec.np_dtype).reshape(spec.shape))
        digests.append(bytes_digest(memoryview(raw)))  # array_digest's bytes: the view is C-contiguous
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
        log.warning("--from-file: %s has no .safetensors file to serve from (a preset, a spec or an .npz): "
                    "it is read into memory instead", source.description)
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


class ChiefArena:
    """The chief's bytes for one round: ``array`` (the whole model's arena), ``specs``, their
    ``digests`` (None until the files are hashed), and with shards each rank's arena."""

    def __init__(self, source: ModelSource, *, ranks: int, trains: bool, chunk_bytes: int | None,
                 shm: bool, from_file: bool, shards, max_bytes: int | None) -> None:
        """``ranks``: the workers; ``trains``: the chief holds replicas too (then it is shard 0
        and worker rank k is shard k + 1). Raises ModelError as ``materialize`` / ``map_files``
        do. With ``shards``, each rank's part is served from where it lies in the model (no
        copy); from files, the parts are hashed with the files (``hash``)."""
        self.description = source.description
        self.shared = self.server = None
        self._shm = shm = shm and shards is None  # the shared arena is the whole model: never a shard
        self.sharded = shards is not None
        self.shard_request, self._world = shards, ranks + (1 if trains else 0)
        self._shard_chunk = chunk_bytes or chunk_bytes_for("star")
        sizes = {chunk_bytes} if chunk_bytes else {chunk_bytes_for(t) for t in TOPOLOGIES}
        self.file = map_files(source, sizes, max_bytes=max_bytes) if from_file else None
        self.digests: list[str] | None
        if self.file is not None:
            # Read and hashed on a thread (hash()) while workers join; the plan waits for it.
            self.specs, self.digests, self.array = self.file.specs, None, self.file.files.array
        elif shm:
            def allocate(n: int) -> np.ndarray:
                self.shared = SharedArena(n)
                return self.shared.array

            self.specs, writable, self.digests = materialize(source, allocate, max_bytes=max_bytes)
            del writable  # the seal needs every writable view of the mapping gone
            self.shared.seal()  # read-only from here on, for the chief too
            self.array = self.shared.array
        else:
            self.specs, self.array, self.digests = materialize(source, max_bytes=max_bytes)
        self.shard_base = 1 if trains else 0
        self.shards: ShardedArenas | None = None
        if shards is not None and self.file is None:
            self.shards = ShardedArenas(self.specs, self.array, shards, self._world, self._shard_chunk)
        self._plans: dict[int, tuple[pb.Plan, pb.Plan]] = {}  # shard index -> (base plan, its plan)
        self._chunkers: dict[int, Chunker] = {}
        self._local: np.ndarray | None = None

    def serve(self, admit: Callable[[str, str], str | None]) -> None:
        """With ``shm``, hand the arena to same-host workers: the sealed memfd, or the model's
        files for them to map. ``admit(worker_id, incarnation)``: None, or why not."""
        if self.shared is not None:
            from collective.transport.shm import ShmServer

            self.server = ShmServer(self.shared, admit)
        elif self.file is not None and self._shm:
            from collective.transport.shm import MAX_FDS, ShmServer

            if len(self.file.files.files) <= MAX_FDS:  # same-host workers map the files themselves
                self.server = ShmServer(self.file.files, admit)
            else:
                log.info("%d files are more than one message passes (%d): workers on this host stream "
                         "the model over loopback", len(self.file.files.files), MAX_FDS)

    def plan(self, workers: list[pb.WorkerInfo], *, chunk_bytes: int, chief_incarnation: str) -> pb.Plan:
        """The round's plan of these bytes; from files, at their offsets with the chunk digests
        read with them; with a server, naming its socket."""
        plan = build_plan(
            self.specs,
            self.digests,
            workers,
            arena=self.array,
            chunk_bytes=chunk_bytes,
            chief_incarnation=chief_incarnation,
            model=self.description,
            offsets=self.file.offsets if self.file is not None else None,
            chunks=self.file.chunk_digests.get(chunk_bytes) if self.file is not None else None,
        )
        if self.server is not None:
            plan.shm_socket, plan.shm_secret = self.server.name, self.server.secret
        return plan

    def plan_of(self, index: int, plan: pb.Plan) -> pb.Plan:
        """The plan shard ``index`` receives: the round's ``plan``, or with shards its own
        (rebuilt when the round's plan object changed: a rejoin revises it)."""
        if self.shards is None:
            return plan
        cached = self._plans.get(index)
        if cached is None or cached[0] is not plan:
            cached = self._plans[index] = (plan, self.shards.plan_for(plan, index))
        return cached[1]

    def chunker_of(self, index: int, plan: pb.Plan) -> Chunker:
        """Shards: the chunker of shard ``index``'s own stream (made once)."""
        if index not in self._chunkers:
            self._chunkers[index] = Chunker(self.plan_of(index, plan), self.shards.views[index])
        return self._chunkers[index]

    def bytes_total(self, index: int) -> int:
        """The bytes shard ``index`` receives: the arena, or its shard's."""
        return int(self.array.nbytes if self.shards is None else self.shards.views[index].nbytes)

    def local(self) -> np.ndarray:
        """What the chief's own replicas are copies of: the arena, or shard 0's (copied out once)."""
        if self.shards is None:
            return self.array
        if self._local is None:
            self._local = self.shards.views[0].copy()
        return self._local

    def hash(self) -> list[str]:
        """Read the model's files once (``FileArena.hash``); with shards, then each rank's part
        and its chunks; return the variables' digests. Raises ModelError naming a file that
        changes meanwhile or cannot be read."""
        try:
            self.file.hash()
            if self.sharded:
                files = self.file.files
                self.shards = ShardedArenas(self.specs, self.array, self.shard_request, self._world, self._shard_chunk,
                                            offsets=self.file.offsets, drop=files.drop)
                files.check()
        except OSError as exc:  # an fstat that fails: the files are gone from under the chief
            raise ModelError(f"{self.description}: cannot read: {exc.strerror or exc}") from None
        return self.file.digests

    def _ranges(self, start: int, end: int | None, shard: int | None) -> list[tuple[int, int | None]]:
        """The model arena's ranges behind bytes ``start..end`` of the arena, or of shard
        ``shard``'s when the round is sharded."""
        if shard is None or self.shards is None:
            return [(start, end)]
        view = self.shards.views[shard]
        return view.sources(start, view.nbytes if end is None else end)

    def check(self, start: int = 0, end: int | None = None, shard: int | None = None) -> None:
        """Served from files: raise ModelError naming a file with bytes in ``start..end`` of the
        arena, or of shard ``shard`` (default all), that changed since it was hashed; else nothing
        to check."""
        if self.file is not None:
            for a, b in self._ranges(start, end, shard):
                self.file.files.check(a, b)

    def drop(self, start: int, end: int, shard: int | None = None) -> None:
        """Served from files: bytes ``start..end`` (of shard ``shard``'s arena) were sent; their
        pages leave this process."""
        if self.file is not None:
            for a, b in self._ranges(start, end, shard):
                self.file.files.drop(a, b)

    def close(self) -> None:
        """Release the shared arena's socket and descriptor (workers keep their mappings)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.shared is not None:
            self.shared.close()
            self.shared = None
