"""gRPC backend: the chief serves ``collective.v1.Collective``; workers are clients.

A worker calls Join, GetPlan (the plan in pieces of 4 MiB, so a plan of any size fits the
message limit), AwaitPrepared (the barrier before the first byte), FetchRaw (the
data stream as raw frames; Fetch is the same stream as protobuf messages), ReportReady (in
pieces too) and AwaitStart; from join until start it sends Heartbeat and holds a Presence call (both on a
connection of their own), and ReportFailure when it fails. Status serves ``collective status``.
FetchRaw is a generic handler outside the .proto; the other ten are the service's RPCs.

Guarantees: every client call has a deadline; a silent data stream is cancelled after the stall
timeout; the chief's errors arrive as the same ``CollectiveError`` class with the same message;
a wrong or missing cluster token gets UNAUTHENTICATED on every Collective RPC before any
handler runs (constant-time comparison; the log names the peer, never the token). The standard
health service reports SERVING while the chief serves and NOT_SERVING once it stops.
"""

from __future__ import annotations

from collective.config import TlsFiles

# The modules, in the order they build on each other: wire (names, limits, frames, errors),
# tls, admission (the token and body deadline), servicer (asyncio, the pool), server (the endpoint),
# client (the link).
from collective.transport.grpc.admission import BODY_TIMEOUT, RefusalLog
from collective.transport.grpc.client import GrpcChiefLink
from collective.transport.grpc.server import GrpcEndpoint, is_loopback
from collective.transport.grpc.servicer import POOL_THREADS
from collective.transport.grpc.tls import (
    RELAY_NAME,
    channel_credentials,
    peer_identities,
    relay_client_tls,
    relay_server_tls,
    self_signed_certificate,
    server_credentials,
)
from collective.transport.grpc.wire import (
    CLIENT_OPTIONS,
    DATA_PATH,
    ERROR_KEY,
    MAX_MESSAGE,
    RAW_FETCH,
    SERVER_OPTIONS,
    SERVICE,
    TOKEN_HEADER,
    frame,
    split_frame,
    status_code,
)

__all__ = [
    "BODY_TIMEOUT", "CLIENT_OPTIONS", "DATA_PATH", "ERROR_KEY", "MAX_MESSAGE",
    "RAW_FETCH", "RELAY_NAME", "SERVER_OPTIONS", "SERVICE", "TOKEN_HEADER", "GrpcChiefLink", "GrpcEndpoint",
    "RefusalLog", "TlsFiles", "frame", "is_loopback", "peer_identities", "POOL_THREADS", "relay_client_tls",
    "relay_server_tls", "self_signed_certificate", "split_frame", "status_code", "server_credentials",
    "channel_credentials",
]
