"""Names, limits and encodings of the gRPC wire: the service, the token header, message options, raw frames, errors."""

from __future__ import annotations

import json
import struct

import grpc
from google.protobuf.message import DecodeError

from collective import errors as E
from collective._proto import collective_pb2 as pb
from collective.limits import MAX_CULPRIT_CHARS
from collective.logs import printable
from collective.plan import MAX_CHUNK_BYTES

TOKEN_HEADER = "x-collective-token"
SERVICE = "collective.v1.Collective"
MAX_MESSAGE = MAX_CHUNK_BYTES + (1 << 20)
_MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]
CLIENT_OPTIONS = _MESSAGE_OPTIONS + [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
]
SERVER_OPTIONS = _MESSAGE_OPTIONS + [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
    # A connection that has not sent its HTTP/2 preface and settings within this is closed
    # (gRPC's default: 120 s): idle strangers must not hold the server's descriptors for long.
    ("grpc.server_handshake_timeout_ms", 20_000),
    # Calls gRPC has accepted but the asyncio server has not yet picked up (it takes them one
    # at a time on its loop). Past gRPC's defaults (1,000, and 3,000 at most) it drops new calls
    # at random, and the client sees CANCELLED (details "CANCELLED", nothing else): with 1,024 workers each holding
    # its plan, presence and heartbeat calls while the chief's loop was busy with the join
    # storm, a worker's GetPlan or AwaitPrepared was dropped so, and the round failed. Room for
    # 16 calls a worker at 1,024 workers; still a bound on what strangers can queue.
    ("grpc.server.max_pending_requests", 16_384),
    ("grpc.server.max_pending_requests_hard_limit", 32_768),
]

# The error table is errors.py's: each class's ``code`` is its status code on the wire, and its
# name, culprit and phase (``errors.describe``, as JSON) travel in this trailing metadata key,
# so the client raises the very class, naming the same culprit.
ERROR_KEY = "collective-error-bin"


def error_metadata(exc: E.CollectiveError) -> tuple[tuple[str, bytes], ...]:
    """``errors.describe(exc)`` for the trailers, its culprit cut (a peer may have named it)."""
    info = E.describe(exc)
    if info.get("culprit"):
        info["culprit"] = printable(info["culprit"], limit=MAX_CULPRIT_CHARS)
    return ((ERROR_KEY, json.dumps(info).encode()),)


def status_code(exc: E.CollectiveError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.ABORTED)


def _raised_class(exc: grpc.RpcError) -> dict | None:
    """What the peer's handler raised (``errors.describe``), or None for a status gRPC made
    itself."""
    try:
        metadata = exc.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - a cancelled future has none
        return None
    raw = next((v for k, v in metadata if k == ERROR_KEY), None)
    try:
        info = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


# --- raw frames -------------------------------------------------------------------------------

# FetchRaw is not in the .proto: a generic handler with identity serialisation, so a chunk's
# bytes are not wrapped in (and copied by) a protobuf message on either side.
RAW_FETCH = f"/{SERVICE}/FetchRaw"
# DataPath (generic, like FetchRaw) answers the port of the raw TCP data path (``rawtcp``) as
# ASCII digits, or nothing when this endpoint has none; the token interceptor guards it.
DATA_PATH = f"/{SERVICE}/DataPath"
_LEN = struct.Struct("<I")


def frame(msg: pb.Chunk, data) -> bytes:
    meta = msg.SerializeToString()
    return b"".join((_LEN.pack(len(meta)), meta, data))


def split_frame(raw: bytes) -> tuple[pb.Chunk, memoryview]:
    """Metadata and bytes of a raw frame. Raises ProtocolError for a malformed frame."""
    if len(raw) < _LEN.size:
        raise E.ProtocolError(f"raw frame of {len(raw)} bytes is shorter than its length prefix")
    (n,) = _LEN.unpack_from(raw, 0)
    if _LEN.size + n > len(raw):
        raise E.ProtocolError(f"raw frame says its metadata has {n} bytes; the frame has {len(raw)}")
    view = memoryview(raw)
    try:
        meta = pb.Chunk.FromString(view[_LEN.size : _LEN.size + n])
    except DecodeError as exc:
        raise E.ProtocolError(f"raw frame metadata is not a Chunk: {exc}") from None
    if meta.data:
        raise E.ProtocolError("raw frame metadata carries bytes of its own")
    return meta, view[_LEN.size + n :]
