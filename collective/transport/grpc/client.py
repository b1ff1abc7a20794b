"""The gRPC client: ``GrpcChiefLink``, a worker's link to the chief or to a relay."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np

from collective import errors as E
from collective._proto import collective_pb2 as pb
from collective._proto import collective_pb2_grpc as pb_grpc
from collective.config import TlsFiles, token_problem
from collective.limits import peer_error
from collective.logs import printable
from collective.plan import MAX_PIECED_BYTES, from_pieces, to_pieces
from collective.transport.api import ChiefLink, StreamSink
from collective.transport.grpc.tls import channel_credentials
from collective.transport.grpc.wire import (
    CLIENT_OPTIONS,
    DATA_PATH,
    MAX_MESSAGE,
    RAW_FETCH,
    TOKEN_HEADER,
    _raised_class,
    split_frame,
)

log = logging.getLogger(__name__)


# --- client ------------------------------------------------------------------------------


class _Collected:
    """A server-streaming method called as ``_unary`` calls a unary one: ``future(...)`` starts
    the call, ``result()`` is ``join(its messages)``, ``cancel()`` ends it.

    ``join`` consumes the messages as they arrive (``plan.from_pieces`` counts the bytes piece
    by piece), so a sender that streams past its limit is refused at the piece that passes it,
    the call cancelled, never gathered whole first."""

    def __init__(self, method, join) -> None:
        self._method, self._join = method, join

    def future(self, request, *, timeout: float, metadata) -> _Collected:
        self._call = self._method(request, timeout=timeout, metadata=metadata)
        return self

    def result(self):
        try:
            return self._join(iter(self._call))
        except E.CollectiveError:
            self._call.cancel()  # refused mid-stream: the sender stops here
            raise

    def cancel(self) -> None:
        self._call.cancel()


class _NoDataPort(Exception):
    """The sender's raw TCP data port cannot be reached: FetchRaw over gRPC instead."""


# Join retries while the chief is not up yet. While its port refuses connections, the worker
# probes it with a bare TCP connect, first after JOIN_FIRST_BACKOFF s, then at doubling intervals
# up to JOIN_BACKOFF s, and opens its channel anew once the port accepts: an SPMD rank 0 listens
# some 10-100 ms after the others start, and a fixed 100 ms pause, then gRPC's own reconnect
# backoff on top (50-170 ms more measured), were most of a small round. Other failures retry
# every JOIN_BACKOFF s at most; gRPC's reconnect backoff is kept as short (RECONNECT_OPTIONS),
# else it would add seconds. Their log lines come after the
# first failure and then at doubling intervals up to JOIN_LOG_CAP s, each a summary.
# Not "grpc.min_reconnect_backoff_ms": gRPC takes it as the least time a connection attempt is
# given, so 100 ms there made every attempt over a path slower than 100 ms (a long haul, or a
# link kept full by the broadcast itself) fail with "connect() timed out", and a relay's child
# failed its round on that first failure. Attempts keep gRPC's own minimum of 20 s; the calls'
# deadlines bound every wait.
JOIN_FIRST_BACKOFF, JOIN_BACKOFF = 0.005, 0.1
JOIN_LOG_FIRST, JOIN_LOG_CAP = 2.0, 30.0
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 100),
]


class GrpcChiefLink(ChiefLink):
    """A worker's channel to the chief at ``address``."""

    def __init__(
        self, address: str, *, token: str | None = None, tls: TlsFiles | None = None, name: str = "chief"
    ) -> None:
        """``name`` is who serves at ``address`` in messages: the chief, or a relay worker."""
        self.address = address
        self.name = name
        bad = token_problem(token) if token else None
        if bad:  # gRPC would fail every call with "Invalid metadata"
            raise E.UsageError(f"cluster token for {name} at {address}: {bad}")
        self._metadata = ((TOKEN_HEADER, token),) if token else ()
        self._token = token
        self.tls = tls if tls is not None and tls.enabled else None
        self._channel = self._open("data")
        self._stub = pb_grpc.CollectiveStub(self._channel)
        # Heartbeats get a TCP connection of their own: on a slow link a reply queued behind
        # megabytes of chunks in the data connection would arrive too late and look like death.
        self._hb_channel = self._open("heartbeat")
        self._hb_stub = pb_grpc.CollectiveStub(self._hb_channel)
        self._lock = threading.Lock()
        self._active: set = set()
        self._interrupted: E.CollectiveError | None = None
        self.retry_window = 0.0  # set by the worker to its heartbeat lease
        self._said_path = False

    def _open(self, purpose: str) -> grpc.Channel:
        # A local subchannel pool keeps the two channels from sharing one connection.
        options = [*CLIENT_OPTIONS, *RECONNECT_OPTIONS, ("grpc.use_local_subchannel_pool", 1),
                   ("collective.purpose", purpose)]
        if self.tls is None:
            return grpc.insecure_channel(self.address, options=options)
        if self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return grpc.secure_channel(self.address, channel_credentials(self.tls), options=options)

    def interrupt(self, error: E.CollectiveError) -> None:
        with self._lock:
            if self._interrupted is None:
                self._interrupted = error
            active = list(self._active)
        for call in active:
            call.cancel()

    def _track(self, call) -> None:
        with self._lock:
            if self._interrupted is not None:
                call.cancel()
            self._active.add(call)

    def _untrack(self, call) -> None:
        with self._lock:
            self._active.discard(call)

    def _error(self, exc: Exception, phase: str, timeout: float) -> E.CollectiveError:
        if not isinstance(exc, grpc.RpcError):
            return E.ChiefUnreachableError(f"{self.name} at {self.address}: {phase} was cancelled")
        return self._error_of(exc.code(), exc.details() or "", phase, timeout, _raised_class(exc))

    def _error_of(self, code: grpc.StatusCode, details: str, phase: str, timeout: float,
                  raised: dict | None = None) -> E.CollectiveError:
        """The error a failed call stands for: what the peer raised (``raised``: its class,
        culprit and phase), or, for a status gRPC made itself, what its code means here."""
        # A peer's text, bounded. Its phase is the peer's own (None for a status gRPC made
        # itself): ``phase`` stays this call's, which the messages below name.
        details, culprit, peer_phase = peer_error(details, raised)
        if raised is not None:
            err = self._raised(E.wire_class(raised.get("class"), code.name), details)
            err.culprit, err.phase = culprit, peer_phase
            return err
        if code == grpc.StatusCode.UNAUTHENTICATED:
            # A holder (collective.fetch) has no chief: the token is the one its holders share.
            what = ("set COLLECTIVE_TOKEN (or token=) to the token the holders were started with"
                    if self.name.startswith("holder") else "pass the chief's token with --token or COLLECTIVE_TOKEN")
            return E.AuthError(f"{self.name} at {self.address} refused the cluster token during {phase} ({details}); {what}")
        if code == grpc.StatusCode.UNAVAILABLE and "Failed parsing HTTP/2" in details:
            # Something answers, but not in gRPC (an HTTP/1 server, say): no retry will help.
            said = " ".join(details[details.index("Failed parsing HTTP/2"):].split())[:200]
            return E.ProtocolError(f"{self.name} at {self.address} does not speak collective's protocol "
                                   f"({said}; is it another kind of server?)")
        if code == grpc.StatusCode.UNAVAILABLE:
            return E.ChiefUnreachableError(f"{self.name} at {self.address} unreachable during {phase}: {details}{self._tls_hint(details)}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and details == "Deadline Exceeded":
            return E.ChiefUnreachableError(f"{self.name} at {self.address} did not answer within {timeout:g} s during {phase}")
        if code == grpc.StatusCode.CANCELLED:
            return E.ChiefUnreachableError(f"{self.name} at {self.address}: {phase} was cancelled ({details})")
        return self._raised(E.wire_class(None, code.name), details)

    def _raised(self, cls: type[E.CollectiveError], details: str) -> E.CollectiveError:
        if cls is not E.AbortedError:
            return cls(f"{self.name} at {self.address}: {details}")
        if self.name == "chief":
            return cls(f"round aborted by the chief at {self.address}: {details}")
        return cls(f"{self.name} at {self.address} ended the stream: {details}")  # a relay is not the chief

    def _tls_hint(self, details: str) -> str:
        # "tcp handshaker shutdown": the TCP connect outlived the try (a chief swamped by a join
        # storm), no TLS refusal; a retry reaches it
        low = details.lower().replace("tcp handshaker", "tcp connect")
        if self.tls is None and ("ssl" in low or "handshake" in low or "socket closed" in low):
            return "; if the chief uses TLS, pass --tls-ca (and --tls-cert/--tls-key for mutual TLS)"
        if self.tls is not None and any(w in low for w in ("ssl", "handshake", "certificate", "socket closed")):
            return (
                "; TLS handshake failed: check that --tls-ca is the CA that signed the chief's certificate, "
                "that the chief's certificate names the host you dial (or set --tls-server-name), and that "
                "your --tls-cert is signed by the CA the chief trusts"
            )
        return ""

    def _unary(self, method, request, phase: str, timeout: float, *, retry: bool = False):
        """One call with a deadline. ``retry``: an idempotent long-poll that rides out a dropped
        connection for up to ``retry_window`` s (the chief restarting, a network blip); the
        heartbeat thread interrupts it sooner if the chief is really gone or restarted."""
        deadline = time.monotonic() + timeout
        down_since = None
        while True:
            if self._interrupted is not None:
                raise self._interrupted
            future = method.future(request, timeout=max(0.01, deadline - time.monotonic()), metadata=self._metadata)
            self._track(future)
            try:
                return future.result()
            except (grpc.RpcError, grpc.FutureCancelledError) as exc:
                if self._interrupted is not None:
                    raise self._interrupted from None
                now = time.monotonic()
                unavailable = (isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE
                               and _raised_class(exc) is None)  # gRPC's own status, not the chief's answer
                if retry and unavailable and now < deadline:
                    down_since = down_since or now
                    if now - down_since < self.retry_window:
                        time.sleep(0.2)
                        continue
                raise self._error(exc, phase, timeout) from None
            finally:
                self._untrack(future)

    def join(self, req: pb.JoinRequest, timeout: float) -> pb.JoinReply:
        size = req.ByteSize()
        if size > MAX_MESSAGE:  # gRPC would refuse it here, in words that blame the chief
            raise E.UsageError(
                f"this worker's join request is {size} bytes ({len(req.declared)} declared variables), more "
                f"than the {MAX_MESSAGE}-byte message limit; join without --expect-model for a model this large"
            )
        started = time.monotonic()
        deadline = started + timeout
        last = "no answer"
        refusals, tries, backoff = 0, 0, JOIN_FIRST_BACKOFF
        next_log, log_every = started, JOIN_LOG_FIRST
        answered = None  # when the chief last said it is still loading: it was there
        while True:
            now = time.monotonic()
            left = deadline - now
            if answered is not None and self.retry_window and now - answered > self.retry_window:
                # It answered, then fell silent for a lease: gone (killed while loading), not
                # yet to come; its whole join timeout would be minutes more of waiting for it.
                raise E.ChiefUnreachableError(
                    f"{self.name} at {self.address} said it was still loading the model, then did not answer "
                    f"for {now - answered:.0f} s (lease {self.retry_window:g} s) while joining ({last}): it is gone"
                )
            if left <= 0:
                raise E.ChiefUnreachableError(
                    f"{self.name} at {self.address} unreachable for {timeout:g} s while joining ({last}); "
                    f"check --chief / COLLECTIVE_CHIEF and that the chief is running{self._tls_hint(last)}"
                )
            try:
                # Fail fast (no wait_for_ready) so a refused handshake shows its real reason.
                return self._stub.Join(req, timeout=min(left, 5.0), metadata=self._metadata)
            except grpc.RpcError as exc:
                raised = _raised_class(exc)
                # Not reached yet, a chief still loading its model (it held the join a while,
                # or answers at once when too many wait), or one with too many large requests in
                # flight (admission's LARGE_IN_FLIGHT); any other answer is final.
                loading = raised is not None and (raised.get("class"), raised.get("phase")) == (
                    "ChiefUnreachableError", "loading")  # chief/pending.py's LOADING
                if loading:
                    answered = time.monotonic()
                if (exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                   grpc.StatusCode.RESOURCE_EXHAUSTED)
                        and (raised is None or loading)):
                    last = exc.details() or exc.code().name
                    hint = self._tls_hint(last)
                    refusals = refusals + 1 if hint else 0
                    if refusals >= 3:  # a listening chief that keeps closing on us: not a start-up race
                        raise E.AuthError(f"{self.name} at {self.address} refused the connection during join: {last}{hint}") from None
                    tries += 1
                    now = time.monotonic()
                    if now >= next_log:  # the first failure, then a summary at doubling intervals
                        log.info("%s at %s not reachable yet after %d tr%s in %.0f s (%s); retrying for %.0f s more",
                                 self.name, self.address, tries, "y" if tries == 1 else "ies", now - started,
                                 printable(last), max(deadline - now, 0.0))
                        next_log, log_every = now + log_every, min(log_every * 2, JOIN_LOG_CAP)
                    # Not yet up (it never answered): wait for its port, not for a timer.
                    if raised is None and answered is None and self._await_listening(
                            min(deadline, max(next_log, time.monotonic() + JOIN_BACKOFF))):
                        continue  # the port has just opened: join now, on a channel without gRPC's backoff
                    time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
                    backoff = min(backoff * 2, JOIN_BACKOFF)
                    continue
                raise self._error(exc, "join", timeout) from None

    def _await_listening(self, deadline: float) -> bool:
        """While the chief's port refuses connections, probe it (a TCP connect) at doubling
        intervals until it accepts or ``deadline`` (the join's, or its next log line). True if
        it refused, then accepted: the data channel is then opened anew, so the join goes at
        once rather than after gRPC's reconnect backoff. False at once if it accepts (the
        failure was another) or cannot be probed, and False at ``deadline``."""
        try:
            host, _, port = self.address.rpartition(":")
            target = (host.strip("[]"), int(port))
        except ValueError:
            return False
        refused, pause = False, JOIN_FIRST_BACKOFF
        while (left := deadline - time.monotonic()) > 0:
            try:
                socket.create_connection(target, timeout=min(1.0, left)).close()
            except ConnectionRefusedError:
                refused = True
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, JOIN_BACKOFF)
                continue
            except OSError:
                return False
            if refused:
                self._channel.close()
                self._channel = self._open("data")
                self._stub = pb_grpc.CollectiveStub(self._channel)
            return refused
        return False

    def get_plan(self, ref: pb.WorkerRef, timeout: float, *, phase: str = "join (waiting for the plan)",
                 max_bytes: int = MAX_PIECED_BYTES) -> pb.Plan:
        def join(pieces):
            return from_pieces(pb.Plan, pieces, f"{self.name} at {self.address}", max_bytes=max_bytes)

        return self._unary(_Collected(self._stub.GetPlan, join), ref, phase, timeout, retry=True)

    def await_prepared(self, ref: pb.WorkerRef, timeout: float) -> pb.PreparedReply:
        return self._unary(self._stub.AwaitPrepared, ref, "waiting for every worker to prepare", timeout, retry=True)

    def fetch(self, ref: pb.WorkerRef, stall_timeout: float) -> Iterator[pb.Chunk]:
        return self._stream(self._stub.Fetch, ref, stall_timeout)

    def receive_into(self, ref: pb.WorkerRef, receiver: StreamSink, stall_timeout: float) -> None:
        """The data stream as raw frames: each chunk's bytes are written once, into the arena.

        A frame is a 4-byte little-endian length, the chunk's metadata (a Chunk without data)
        and its bytes, carried by FetchRaw without protobuf around the bytes.
        """
        port, unix_name = self._data_port(stall_timeout)
        if port:
            try:
                return self._receive_raw_tcp(port, unix_name, ref, receiver, stall_timeout)
            except _NoDataPort as exc:
                log.warning("%s at %s: its data port %d cannot be reached (%s); receiving over gRPC",
                            self.name, self.address, port, exc)
        raw = self._channel.unary_stream(
            RAW_FETCH, request_serializer=pb.WorkerRef.SerializeToString, response_deserializer=None
        )
        for frame in self._stream(raw, ref, stall_timeout):
            meta, data = split_frame(frame)
            view = receiver.view(meta.offset, len(data))  # checks offset and length first
            if len(data):
                view[...] = np.frombuffer(data, dtype=np.uint8)
            receiver.accept(meta, placed=True)

    def _data_port(self, timeout: float) -> tuple[int, str | None]:
        """The sender's raw data path: its TCP port (0: none, switched off or an older sender)
        and the name of its abstract unix socket, if it has one."""
        from collective.transport import rawtcp

        if not rawtcp.enabled():
            return 0, None
        ask = self._channel.unary_unary(DATA_PATH, request_serializer=None, response_deserializer=None)
        if self._interrupted is not None:
            raise self._interrupted
        future = ask.future(b"", timeout=timeout, metadata=self._metadata)
        self._track(future)
        try:
            answer = future.result()
        except (grpc.RpcError, grpc.FutureCancelledError) as exc:
            if self._interrupted is not None:
                raise self._interrupted from None
            if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return 0, None
            raise self._error(exc, "receive", timeout) from None
        finally:
            self._untrack(future)
        port, _, unix_name = answer.decode(errors="replace").partition(" ")
        return (int(port), unix_name or None) if port.isdigit() else (0, None)

    def _receive_raw_tcp(self, port: int, unix_name: str | None, ref: pb.WorkerRef, receiver,
                         stall_timeout: float) -> None:
        """The data stream over the raw TCP data path (see ``rawtcp``), errors mapped as for gRPC."""
        import ssl

        from collective.transport import rawtcp

        if self._interrupted is not None:
            raise self._interrupted
        host = rawtcp.split_host(self.address)[0]
        server_name = self.tls.server_name if self.tls else None
        try:
            sock = rawtcp.connect(host, port, timeout=stall_timeout, server_name=server_name,
                                  unix_name=unix_name if rawtcp.mode() == "auto" else None,
                                  tls=rawtcp.client_context(self.tls) if self.tls else None)
        except rawtcp.Refused as exc:
            raise _NoDataPort(str(exc)) from None
        except (OSError, ssl.SSLError) as exc:
            raise E.ChiefUnreachableError(
                f"{self.name} at {self.address} unreachable during receive: data port {port}: {exc}"
                f"{self._tls_hint(str(exc))}"
            ) from None
        # Once per link at INFO: a fetch striped over many streams says it once, not per stripe.
        log.log(logging.DEBUG if self._said_path else logging.INFO, "receiving from %s at %s over its raw data path (%s)",
                self.name, self.address, "unix socket, same host" if sock.family == socket.AF_UNIX else f"TCP port {port}")
        self._said_path = True
        try:
            rawtcp.receive(
                sock, ref, self._token, receiver, stall_timeout=stall_timeout,
                track=self._track, untrack=self._untrack,
                fail=lambda code, raised, message: self._error_of(
                    getattr(grpc.StatusCode, code, grpc.StatusCode.ABORTED), message, "receive", stall_timeout, raised),
            )
        except (OSError, ssl.SSLError) as exc:
            if self._interrupted is not None:
                raise self._interrupted from None
            if isinstance(exc, socket.timeout):
                raise E.ChiefUnreachableError(
                    f"{self.name} at {self.address} sent nothing for {stall_timeout:g} s during receive"
                ) from None
            # Reachable a moment ago (it sent this stream): the stream broke, which its own words say.
            raise E.ChiefUnreachableError(
                f"the data stream from {self.name} at {self.address} broke off during receive ({exc})"
            ) from None
        except E.CollectiveError:
            if self._interrupted is not None:
                raise self._interrupted from None
            raise

    def _stream(self, method, ref: pb.WorkerRef, stall_timeout: float) -> Iterator:
        """A server stream with a stall watchdog; errors mapped as for every call."""
        if self._interrupted is not None:
            raise self._interrupted
        call = method(ref, metadata=self._metadata)
        self._track(call)
        last = [time.monotonic()]
        stalled = threading.Event()
        done = threading.Event()

        def watchdog() -> None:
            while not done.wait(min(1.0, stall_timeout / 4)):
                if time.monotonic() - last[0] > stall_timeout:
                    stalled.set()
                    call.cancel()
                    return

        threading.Thread(target=watchdog, name="stall-watchdog", daemon=True).start()
        try:
            for message in call:
                last[0] = time.monotonic()
                yield message
        except grpc.RpcError as exc:
            if self._interrupted is not None:
                raise self._interrupted from None
            if stalled.is_set():
                raise E.ChiefUnreachableError(
                    f"{self.name} at {self.address} sent nothing for {stall_timeout:g} s during receive"
                ) from None
            raise self._error(exc, "receive", stall_timeout) from None
        finally:
            done.set()
            call.cancel()
            self._untrack(call)

    def report_ready(self, req: pb.ReadyRequest, timeout: float) -> pb.ReadyReply:
        return self._unary(self._stub.ReportReady, _named(req.worker, to_pieces(req.SerializeToString())), "ready", timeout)

    def await_start(self, ref: pb.WorkerRef, timeout: float) -> pb.StartReply:
        return self._unary(self._stub.AwaitStart, ref, "waiting for start", timeout + 1.0, retry=True)

    def report_failure(self, req: pb.FailureReport, timeout: float) -> None:
        try:
            self._stub.ReportFailure(req, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            log.debug("could not tell the chief about the failure: %s", exc.details())

    def heartbeat(self, ref: pb.HeartbeatRequest, timeout: float) -> pb.HeartbeatReply:
        try:
            return self._hb_stub.Heartbeat(ref, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._error(exc, "heartbeat", timeout) from None

    def status(self, timeout: float, brief: bool = False) -> pb.StatusReply:
        return self._unary(self._stub.Status, pb.StatusRequest(brief=brief), "status", timeout)

    def presence(self, ref: pb.WorkerRef, timeout: float) -> pb.HeartbeatReply:
        """On the heartbeat connection, which carries no data, so nothing queues ahead of it."""
        return self._unary(self._hb_stub.Presence, ref, "presence", timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Close both channels, waiting at most ``timeout`` s. grpc's close waits for every call
        on the channel to end, and a call interrupted inside grpc (Ctrl-C during a long-poll) may
        never report its end: the close then goes on in a daemon thread and the process exits."""
        closer = threading.Thread(target=self._close_channels, name="grpc-close", daemon=True)
        closer.start()
        closer.join(timeout)
        if closer.is_alive():
            log.debug("%s at %s: its channels did not close within %g s; leaving them", self.name, self.address, timeout)

    def _close_channels(self) -> None:
        self._channel.close()
        self._hb_channel.close()


def _named(worker: pb.WorkerRef, pieces):
    """``pieces`` with the first naming the sender (``Piece.worker``): the chief refuses a report
    at its first piece unless it comes from a member."""
    for i, piece in enumerate(pieces):
        if i == 0:
            piece.worker.CopyFrom(worker)
        yield piece
