"""What a peer's request may hold: every limit on a field a worker chooses, in one place.

The chief checks a request against these before it takes its lock (``check_join``), in time
linear in the request's size, so one oversize request (100,001 devices, a million declared
variables) is refused at once with INVALID_ARGUMENT naming the field and the limit, and never
holds the lock that every other call and the status need. Each limit is far above what a real
run uses (a worker has at most a few dozen devices; the largest models have tens of thousands of
variables; a worker id is a host name and a number).
"""

from __future__ import annotations

from collective._proto import collective_pb2 as pb
from collective.errors import ProtocolError
from collective.logs import printable

MAX_DEVICES = 4096  # devices of one worker
MAX_DEVICE_CHARS = 64  # one device string, e.g. "/device:CPU:12"
MAX_DEVICE_INDEX_DIGITS = 9  # "cpu:123456789": far below Python's 4,300-digit int limit
MAX_ID_CHARS = 256  # a worker id (a host name is at most 253)
MAX_INCARNATION_CHARS = 128
MAX_HOST_CHARS = 256
MAX_SECRET_CHARS = 128  # a join key or member secret
MAX_DECLARED_VARIABLES = 100_000  # 5x the largest plan tested (20,000); or the model's own count, when larger
DECLARED_EXTRA = 1000  # a declaration longer than the model by more is refused by its count, not compared
MAX_NAME_CHARS = 4096  # a declared variable's name
MAX_HOLDER_NAME_CHARS = 200  # a publication's name (publish(name=)), as fetchers print it
MAX_DIMS = 64  # a declared variable's shape
MAX_MODE_CHARS = 64  # a declared dtype, synchronization or aggregation
MAX_RELAY_CERT_BYTES = 64 << 10  # a PEM certificate is a few KiB
MAX_ERROR_CHARS = 4000  # an error's message as sent back to a peer, cut (``logs.printable``) where it is sent
MAX_CULPRIT_CHARS = 300  # the culprit named beside it
MAX_PHASE_CHARS = 64  # and the phase ("receive", "ready": a word)
# A published state's holder, as its fetcher sees it (collective.snapshot): refused before
# anything is allocated for it.
MAX_SNAPSHOT_PLAN_BYTES = 256 << 20  # its plan: 100,000 tensors and 1 TiB of chunk digests fit
MAX_SNAPSHOT_TREE_BYTES = 64 << 20  # its structure (JSON): a few MiB for 100,000 tensors with long names
MAX_SNAPSHOT_TREE_DEPTH = 64  # the structure's nesting (a state_dict is 3 or 4 levels deep)
# Its chunks: each costs the fetcher a digest, a frame and a check whatever its size, so a plan
# of 1-byte chunks (2 MB in 119 s and 1.2 GB) is refused. Chunks below the floor are accepted
# for a small state only, of at most SMALL_PLAN_CHUNKS chunks.
MIN_SNAPSHOT_CHUNK_BYTES = 64 << 10
SMALL_PLAN_CHUNKS = 1024


def snapshot_chunking_refused(total_bytes: int, chunk_bytes: int) -> str | None:
    """Why a published state of ``total_bytes`` in chunks of ``chunk_bytes`` is refused (a
    fetch refuses such a plan, publish such a ``chunk_bytes``), or None."""
    if chunk_bytes >= MIN_SNAPSHOT_CHUNK_BYTES or chunk_bytes <= 0:
        return None
    chunks = -(-total_bytes // chunk_bytes)
    if chunks <= SMALL_PLAN_CHUNKS:
        return None
    return (f"{chunks} chunks of {chunk_bytes} bytes: chunks below {MIN_SNAPSHOT_CHUNK_BYTES >> 10} KiB are for "
            f"states of at most {SMALL_PLAN_CHUNKS} chunks")


def declared_limit(model_variables: int) -> int:
    """How many variables a worker may declare: the cap, or the chief's model's own count."""
    return max(MAX_DECLARED_VARIABLES, model_variables)


def join_fields_limit(model_variables: int) -> int:
    """The most top-level fields a serialized JoinRequest may have (its devices, its declared
    variables, and its ten others): counted on the wire before it is decoded."""
    return MAX_DEVICES + declared_limit(model_variables) + 16


def _at_most(field: str, size: int, limit: int, unit: str = "characters") -> None:
    if size > limit:
        raise ProtocolError(f"request refused: {field} has {size} {unit}; the limit is {limit}")


def check_ref(ref: pb.WorkerRef | pb.HeartbeatRequest | pb.JoinRequest) -> None:
    """A call's worker id, incarnation and secret within their limits (ProtocolError naming the
    field otherwise)."""
    _at_most("worker_id", len(ref.worker_id), MAX_ID_CHARS)
    _at_most("incarnation", len(ref.incarnation), MAX_INCARNATION_CHARS)
    _at_most("secret", len(getattr(ref, "secret", "")), MAX_SECRET_CHARS)


def check_join(req: pb.JoinRequest, model_variables: int = 0) -> None:
    """Every field of a JoinRequest within its limit; ProtocolError (INVALID_ARGUMENT) naming the
    first field past its limit, and the limit. Linear in the request's size."""
    check_ref(req)
    _at_most("host", len(req.host), MAX_HOST_CHARS)
    _at_most("join_key", len(req.join_key), MAX_SECRET_CHARS)
    _at_most("devices", len(req.devices), MAX_DEVICES, "entries")
    longest = max((len(d) for d in req.devices), default=0)
    _at_most("a device", longest, MAX_DEVICE_CHARS)
    _at_most("relay_cert", len(req.relay_cert), MAX_RELAY_CERT_BYTES, "bytes")
    _at_most("declared", len(req.declared), declared_limit(model_variables), "variables")
    for v in req.declared:
        _at_most("a declared variable's name", len(v.name), MAX_NAME_CHARS)
        _at_most(f"declared variable {v.name!r}'s shape", len(v.shape), MAX_DIMS, "dimensions")
        _at_most(f"declared variable {v.name!r}'s modes",
                 max(len(v.dtype), len(v.synchronization), len(v.aggregation)), MAX_MODE_CHARS)


def peer_error(message: str, info: dict | None) -> tuple[str, str | None, str | None]:
    """(message, culprit, phase) of an error a peer sent (``info``: ``errors.describe`` as it
    arrived), each one printable line cut to its limit (``logs.printable``). Every transport's
    error decoding passes what it received through this before it builds the error, so a peer's
    text, however long, never reaches a message, a log line or a terminal whole (the gRPC link's
    ``_error_of``, for gRPC statuses and raw-path error frames; MPI's ``decode_outcome``): an
    honest sender cuts its own the same way."""
    info = info or {}
    culprit, phase = info.get("culprit"), info.get("phase")
    return (printable(message, limit=MAX_ERROR_CHARS),
            None if culprit is None else printable(culprit, limit=MAX_CULPRIT_CHARS),
            None if phase is None else printable(phase, limit=MAX_PHASE_CHARS))
