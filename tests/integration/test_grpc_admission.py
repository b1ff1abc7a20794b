"""The gRPC server boundary: admission from headers, the servicer catch-all, pool sizing, logs.

Real gRPC servers and channels on loopback; the chief runs in this process (``ChiefService`` behind
a ``GrpcEndpoint``, as a training script serving it through the Python API would) and its
workers join through ``worker.api.join_cluster`` in threads.
"""

from __future__ import annotations

import logging
import threading

import grpc
import pytest

from collective import errors as E
from collective._proto import collective_pb2 as pb
from collective.config import Timeouts
from collective.transport.grpc import SERVICE, TOKEN_HEADER, GrpcChiefLink, GrpcEndpoint
from tests.conftest import ArraySource, run_threads, small_arrays

pytestmark = pytest.mark.integration

TOKEN = "the-token"
ROUND = Timeouts(join=30.0, straggler_log=5.0, rpc=10.0, stall=10.0, ready=20.0, start=20.0, linger=2.0)


class IdleCalls:
    """``n`` calls that send their headers and never a request body (a slow-loris)."""

    def __init__(self, address: str, n: int, metadata=()) -> None:
        self._release = threading.Event()
        self._channel = grpc.insecure_channel(address)
        methods = ["Join", "GetPlan", "Heartbeat", "Fetch", "Status", "Presence"]

        def body():
            self._release.wait(120)
            return
            yield  # a generator that blocks, then ends without a message

        self.calls = [
            self._channel.stream_stream(f"/{SERVICE}/{methods[i % len(methods)]}")(body(), metadata=metadata)
            for i in range(n)
        ]

    def codes(self, timeout: float) -> list:
        """Each call's status code once it ends (None if it is still open after ``timeout`` s)."""
        out = []
        for call in self.calls:
            done = threading.Event()
            call.add_done_callback(lambda _c, done=done: done.set())
            out.append(call.code() if done.wait(timeout) else None)
        return out

    def close(self) -> None:
        self._release.set()
        for call in self.calls:
            call.cancel()
        self._channel.close()


def serve_round(n: int, *, token: str | None = TOKEN, before=None, **endpoint_options):
    """A chief on loopback with ``n`` workers in threads; ``before(address)`` runs once the chief
    listens and before any worker starts. Returns (supervise's error or None, worker results)."""
    from chief.service import ChiefService
    from worker.api import join_cluster

    service = ChiefService(ArraySource(small_arrays()), n, timeouts=ROUND, chunk_bytes=4096)
    endpoint = GrpcEndpoint("127.0.0.1:0", token=token, **endpoint_options)
    address = endpoint.start(service)
    outcome: list = []
    supervisor = threading.Thread(target=lambda: outcome.append(_catch(service.supervise)), daemon=True)
    supervisor.start()
    try:
        if before is not None:
            before(address)
        workers = [
            (lambda i=i: join_cluster(address, worker_id=f"w{i}", token=token, timeouts=ROUND))
            for i in range(n)
        ]
        results = run_threads(workers, timeout=90)
        supervisor.join(60)
        assert not supervisor.is_alive(), "supervise() did not return"
        return outcome[0], results
    finally:
        endpoint.stop(grace=0.5)
        service.close()


def _catch(fn):
    try:
        fn()
    except E.CollectiveError as exc:
        return exc
    return None


# --- item 4: slow-loris ------------------------------------------------------------------------


def test_a_round_completes_while_4n_plus_8_unauthenticated_calls_send_headers_and_no_body():
    n = 2
    idle: list[IdleCalls] = []

    def attack(address):
        idle.append(IdleCalls(address, 4 * n + 8))

    try:
        error, results = serve_round(n, before=attack)
        assert error is None, error
        assert all(not isinstance(r, BaseException) for r in results), results
        # Refused from their headers alone: none of them waited for a body.
        assert set(idle[0].codes(timeout=10)) == {grpc.StatusCode.UNAUTHENTICATED}
    finally:
        for calls in idle:
            calls.close()


def test_calls_with_the_token_but_no_body_are_cut_after_the_body_timeout_and_the_round_completes():
    n = 2
    idle: list[IdleCalls] = []

    def attack(address):
        idle.append(IdleCalls(address, 4 * n + 8, metadata=((TOKEN_HEADER, TOKEN),)))

    try:
        error, results = serve_round(n, before=attack, body_timeout=1.0)
        assert error is None, error
        assert all(not isinstance(r, BaseException) for r in results), results
        assert set(idle[0].codes(timeout=10)) == {grpc.StatusCode.CANCELLED}
    finally:
        for calls in idle:
            calls.close()


def test_a_relay_answers_while_more_unauthenticated_calls_than_its_threads_send_no_body():
    from worker.relay import Relay

    relay = Relay("127.0.0.1:0", token=TOKEN, tls=None, stall_timeout=5.0)
    idle = IdleCalls(f"127.0.0.1:{relay.port}", 16)
    link = GrpcChiefLink(f"127.0.0.1:{relay.port}", token=TOKEN, name="relay")
    try:
        assert set(idle.codes(timeout=10)) == {grpc.StatusCode.UNAUTHENTICATED}
        with pytest.raises(E.UnimplementedError, match="relay"):
            link.status(timeout=5)
    finally:
        link.close()
        idle.close()
        relay.stop()
