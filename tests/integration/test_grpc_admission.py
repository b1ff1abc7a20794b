"""The gRPC server boundary: admission from headers, the servicer catch-all, pool sizing, logs.

Real gRPC servers and channels on loopback; the chief runs in this process (``ChiefService`` behind
a ``GrpcEndpoint``, as a training script serving it through the Python API would) and its
workers join through ``collective.join`` in threads.
"""

from __future__ import annotations

import logging
import threading

import grpc
import pytest

from collective import errors as E
from collective._proto import collective_pb2 as pb
from collective.transport.grpc import SERVICE, TOKEN_HEADER, GrpcChiefLink, GrpcEndpoint
from tests.clusters import ROUND, TOKEN, chief_service, grpc_link, grpc_round

pytestmark = pytest.mark.integration



ERROR_FAMILY = E.family()


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


# --- item 4: slow-loris ------------------------------------------------------------------------


def test_a_round_completes_while_4n_plus_8_unauthenticated_calls_send_headers_and_no_body():
    n = 2
    idle: list[IdleCalls] = []

    def attack(address):
        idle.append(IdleCalls(address, 4 * n + 8))

    try:
        error, results = grpc_round(n, before=attack)
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
        error, results = grpc_round(n, before=attack, body_timeout=1.0)
        assert error is None, error
        assert all(not isinstance(r, BaseException) for r in results), results
        # Cut after the body timeout, or sooner once half the pool waited for bodies; the few
        # still waiting when the round (no longer starved of threads) ended got the shutdown.
        codes = idle[0].codes(timeout=10)
        assert set(codes) <= {grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE}, codes
        assert codes.count(grpc.StatusCode.CANCELLED) >= len(codes) // 2, codes
    finally:
        for calls in idle:
            calls.close()


def test_a_relay_answers_while_more_unauthenticated_calls_than_its_threads_send_no_body():
    from collective.worker.relay import Relay

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


# --- item 10: one catch-all at the servicer boundary ---------------------------------------------


class BrokenHandler:
    """A handler with a bug in Status and Fetch, and a refusal (a CollectiveError) in Join."""

    num_workers = 1

    def status(self, brief=False):
        raise ValueError("boom")

    def fetch(self, ref):
        raise RuntimeError("stream bug")
        yield  # pragma: no cover

    error: E.CollectiveError = E.AlreadyExistsError("worker id 'w0' is taken")

    def join(self, req, peer):
        raise self.error

    def lost(self, ref, reason):
        pass


@pytest.fixture
def broken_chief():
    with grpc_link(BrokenHandler()) as link:
        yield link


def test_an_unexpected_exception_in_a_handler_is_internal_with_a_traceback_in_the_servers_log(broken_chief, caplog):
    with pytest.raises(E.InternalError, match=r"Status failed inside the chief \(ValueError: boom\)"):
        broken_chief.status(timeout=5)
    with pytest.raises(E.InternalError, match=r"Fetch failed inside the chief \(RuntimeError: stream bug\)"):
        list(broken_chief.fetch(pb.WorkerRef(worker_id="w0"), stall_timeout=5))
    logged = [r for r in caplog.records if r.levelno == logging.ERROR and r.exc_info]
    assert {r.getMessage().split()[0] for r in logged} == {"Status", "Fetch"}
    assert {type(r.exc_info[1]) for r in logged} == {ValueError, RuntimeError}


def test_a_collective_error_in_a_handler_keeps_its_class_on_the_client(broken_chief):
    with pytest.raises(E.AlreadyExistsError, match="'w0' is taken"):
        broken_chief.join(pb.JoinRequest(worker_id="w0"), timeout=5)


@pytest.mark.parametrize("cls", ERROR_FAMILY, ids=lambda c: c.__name__)
def test_every_error_class_a_handler_raises_arrives_as_that_class_with_its_exit_code(broken_chief, cls, monkeypatch):
    monkeypatch.setattr(BrokenHandler, "error", cls("refused for a test", culprit="wörker-7", phase="join"))
    with pytest.raises(cls, match="refused for a test") as info:
        broken_chief.join(pb.JoinRequest(worker_id="w0"), timeout=5)
    assert type(info.value) is cls and info.value.exit_code == cls.exit_code
    assert (info.value.culprit, info.value.phase) == ("wörker-7", "join")  # not ASCII: the -bin key


@pytest.mark.parametrize("cls", ERROR_FAMILY, ids=lambda c: c.__name__)
def test_every_error_class_crosses_the_mpi_codec_as_that_class(cls):
    from collective.transport.mpi import decode_outcome, encode_error

    with pytest.raises(cls, match="refused for a test") as info:
        decode_outcome(encode_error(cls("refused for a test", culprit="mpi-rank-2", phase="ready")), pb.JoinReply)
    assert type(info.value) is cls and (info.value.culprit, info.value.phase) == ("mpi-rank-2", "ready")


def test_a_relay_answers_unimplemented_to_every_call_but_the_data_stream():
    from collective.worker.relay import Relay

    relay = Relay("127.0.0.1:0", token=TOKEN, tls=None, stall_timeout=5.0)
    link = GrpcChiefLink(f"127.0.0.1:{relay.port}", token=TOKEN, name="relay")
    ref = pb.WorkerRef(worker_id="w1", incarnation="i")
    calls = {
        "GetPlan": lambda: link.get_plan(ref, 5),
        "AwaitPrepared": lambda: link.await_prepared(ref, 5),
        "ReportReady": lambda: link.report_ready(pb.ReadyRequest(worker=ref), 5),
        "AwaitStart": lambda: link.await_start(ref, 5),
        "Presence": lambda: link.presence(ref, 5),
        "Heartbeat": lambda: link.heartbeat(ref, 5),
        "Status": lambda: link.status(5),
    }
    try:
        for name, call in calls.items():
            with pytest.raises(E.UnimplementedError, match="worker's relay: it serves only the data stream"):
                call()
                pytest.fail(f"{name} was answered")
    finally:
        link.close()
        relay.stop()


def test_report_ready_before_the_plan_is_answered_without_aborting_the_round():
    with grpc_link(chief_service(workers=2, timeouts=ROUND)) as link:
        reply = link.join(pb.JoinRequest(worker_id="w0", incarnation="i0", devices=["cpu:0"]), timeout=5)
        assert reply.rank == 0
        ref = pb.WorkerRef(worker_id="w0", incarnation="i0", secret=reply.secret)
        with pytest.raises(E.PreconditionError, match="w0.* reported ready before the plan was released"):
            link.report_ready(pb.ReadyRequest(worker=ref), timeout=5)
        assert link.status(timeout=5).phase == "joining"


def test_a_worker_declaring_a_variable_with_a_bad_dtype_is_refused_by_name_not_by_a_crash():
    declared = [pb.VariableInfo(name="odd", shape=[2], dtype="not-a-dtype")]
    with grpc_link(chief_service(workers=1, timeouts=ROUND)) as link:
        # The declaration is checked like a model before it is compared: a protocol error naming it.
        with pytest.raises(E.ProtocolError, match="declares an invalid variable list: variable 'odd'"):
            link.join(pb.JoinRequest(worker_id="w0", incarnation="i0", devices=["cpu:0"], declared=declared), 5)


# --- item 11: the endpoint sizes its own pool ------------------------------------------------------


def test_a_chief_served_through_the_python_api_with_9_workers_completes_with_the_default_pool():
    error, results = grpc_round(9)
    assert error is None, error
    assert all(not isinstance(r, BaseException) for r in results), results


# --- item 13: logs that a peer cannot flood or forge -----------------------------------------------


def test_an_undecodable_request_is_refused_without_a_traceback_with_or_without_the_token(broken_chief, caplog):
    with grpc.insecure_channel(broken_chief.address) as channel:
        join = channel.unary_unary(f"/{SERVICE}/Join")
        for metadata, code in [((), grpc.StatusCode.UNAUTHENTICATED),
                               (((TOKEN_HEADER, TOKEN),), grpc.StatusCode.INVALID_ARGUMENT)]:
            with pytest.raises(grpc.RpcError) as info:
                join(b"\xff\xff\xff\xff", timeout=5, metadata=metadata)
            assert info.value.code() == code
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_wrong_token_flood_is_logged_once_then_summarised():
    endpoint = GrpcEndpoint("127.0.0.1:0", token=TOKEN)
    address = endpoint.start(BrokenHandler())
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("collective.transport.grpc")
    logger.addHandler(handler)
    try:
        with grpc.insecure_channel(address) as channel:
            status = channel.unary_unary(f"/{SERVICE}/Status")
            for _ in range(200):
                with pytest.raises(grpc.RpcError):
                    status(b"", timeout=5, metadata=((TOKEN_HEADER, "wrong"),))
        during = [r.getMessage() for r in records if r.levelno == logging.WARNING]
        endpoint.stop(grace=0.5)
    finally:
        logger.removeHandler(handler)
    assert len(during) == 1 and "refused Status" in during[0] and "a wrong cluster token" in during[0]
    summary = [r.getMessage() for r in records if "more refused call(s)" in r.getMessage()]
    assert len(summary) == 1 and summary[0].startswith("199 more refused call(s) from 127.0.0.1"), summary


def test_join_retries_back_off_and_log_summaries_not_a_line_a_second(caplog):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    link = GrpcChiefLink(f"127.0.0.1:{port}", token=TOKEN)
    caplog.set_level(logging.INFO, logger="collective.transport.grpc")
    try:
        with pytest.raises(E.ChiefUnreachableError):
            link.join(pb.JoinRequest(worker_id="w0"), timeout=8)
    finally:
        link.close()
    lines = [r.getMessage() for r in caplog.records if "not reachable yet" in r.getMessage()]
    assert 1 <= len(lines) <= 3, lines
    assert "after 1 try" in lines[0]
    assert all("tries" in line for line in lines[1:]), lines


def test_a_worker_that_called_first_joins_on_a_fresh_channel_once_the_port_opens():
    """Issue 39: an SPMD rank 0 listens some 10-100 ms after the others call; a worker that
    found the port closed probes it and, once it accepts, joins on a channel opened anew,
    rather than waiting out gRPC's reconnect backoff (50-170 ms more, measured)."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    service = chief_service(workers=1)
    endpoint = GrpcEndpoint(f"127.0.0.1:{port}", token=TOKEN)
    link = GrpcChiefLink(f"127.0.0.1:{port}", token=TOKEN)
    opened, open_channel = [], link._open
    link._open = lambda purpose: (opened.append(purpose), open_channel(purpose))[1]

    def serve_later() -> None:
        time.sleep(0.3)
        endpoint.start(service)

    later = threading.Thread(target=serve_later, daemon=True)
    later.start()
    try:
        reply = link.join(pb.JoinRequest(worker_id="w0", incarnation="i0", devices=["cpu:0"], host="h"), timeout=30)
        assert reply.rank == 0 and reply.num_workers == 1
        assert opened == ["data"], opened  # the channel that had met the closed port, replaced
    finally:
        later.join(10)
        link.close()
        endpoint.stop(grace=0.5)
        service.close()


# --- item 14: who may listen where -------------------------------------------------------------------


@pytest.mark.parametrize(("bind", "token", "warned"), [
    ("0.0.0.0:0", None, True), ("[::]:0", None, True), ("0.0.0.0:0", TOKEN, False), ("127.0.0.1:0", None, False),
])
def test_listening_beyond_loopback_without_a_token_is_a_loud_warning(caplog, bind, token, warned):
    endpoint = GrpcEndpoint(bind, token=token)
    endpoint.start(BrokenHandler())
    endpoint.stop(grace=0.1)
    loud = [r for r in caplog.records if r.levelno == logging.WARNING and "WITHOUT a cluster token" in r.getMessage()]
    assert bool(loud) == warned



def _listening(pid: int) -> set[str]:
    """Local addresses of the TCP sockets process ``pid`` listens on (from /proc)."""
    import ipaddress

    from tests.procs import socket_inodes

    inodes = socket_inodes(pid)
    out = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as fh:
            for line in list(fh)[1:]:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:  # LISTEN
                    raw = bytes.fromhex(f[1].split(":")[0])
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    addr = ipaddress.ip_address(words)
                    out.add(str(addr.ipv4_mapped or addr) if addr.version == 6 else str(addr))
    return out


def test_a_workers_relay_listens_only_on_the_interface_that_reaches_a_loopback_chief(cluster):
    import time

    cluster.chief("--workers", "2", "--join-timeout", "30", env={"COLLECTIVE_TOKEN": TOKEN})
    worker = cluster.worker("w0", env={"COLLECTIVE_TOKEN": TOKEN})
    deadline = time.monotonic() + 30
    while not _listening(worker.pid) and time.monotonic() < deadline:
        assert worker.proc.poll() is None, worker.output()
        time.sleep(0.05)
    assert _listening(worker.pid) and _listening(worker.pid) <= {"127.0.0.1", "::1"}, worker.output()


def test_a_worker_id_host_and_failure_message_with_newlines_and_escapes_are_logged_escaped(caplog):
    caplog.set_level(logging.INFO)
    evil = "w0\nFORGED ERROR line\x1b[2J"
    with grpc_link(chief_service(workers=2, timeouts=ROUND)) as link:
        secret = link.join(pb.JoinRequest(worker_id=evil, incarnation="i0", devices=["cpu:0"], host="h\x1b[31m\r"), 5).secret
        link.report_failure(pb.FailureReport(worker=pb.WorkerRef(worker_id=evil, incarnation="i0", secret=secret),
                                             message="disk\nfull\x1b[0m"), 5)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("collective.chief")]
    assert any("joined" in m for m in messages) and any("disk\\x0afull" in m for m in messages), messages
    assert not [m for m in messages if any(c in m for c in "\n\r\x1b")], messages


def test_a_localhost_server_takes_one_port_free_on_both_loopbacks_not_one_a_stranger_holds_on_one():
    # gRPC binds "localhost:0" on ::1 and 127.0.0.1 with the port the first got; when a stranger
    # held that port on the other, gRPC only warned, and peers dialling 127.0.0.1 reached the
    # stranger (a chain's child under load). The endpoint now picks a port free on both.
    import socket

    from collective.transport.grpc.server import _same_port_everywhere

    if not socket.has_ipv6:
        pytest.skip("this host has no IPv6, so localhost is one address")
    with socket.socket(socket.AF_INET6) as v6:
        try:
            v6.bind(("::1", 0))
        except OSError as exc:
            pytest.skip(f"no ::1 here ({exc.strerror}): localhost is one address")
        taken = v6.getsockname()[1]  # free on 127.0.0.1? then a stranger takes it there
    with socket.socket() as stranger:
        stranger.bind(("127.0.0.1", taken))
        stranger.listen(1)
        chosen = _same_port_everywhere("localhost:0", first=(taken,))
        host, _, port = chosen.rpartition(":")
        assert host == "localhost" and int(port) not in (0, taken), chosen
        for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            with socket.socket(family) as s:
                s.bind((address, int(port)))  # free on both


def test_a_relay_on_localhost_answers_on_both_loopbacks_at_one_port():
    import socket

    from collective.worker.relay import Relay

    relay = Relay("localhost:0", token=TOKEN, tls=None, stall_timeout=5)
    try:
        for address in ("127.0.0.1", "[::1]"):
            if address == "[::1]" and not socket.has_ipv6:
                continue
            with grpc.insecure_channel(f"{address}:{relay.port}") as channel:
                with pytest.raises(grpc.RpcError) as info:
                    channel.unary_unary(f"/{SERVICE}/Status")(b"", timeout=10, metadata=((TOKEN_HEADER, TOKEN),))
                assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED, (address, info.value)  # the relay itself
    finally:
        relay.stop()


def test_calls_queued_while_the_servers_loop_is_busy_are_all_served():
    """gRPC holds the calls the asyncio server has not picked up yet; past its default backlog
    (1,000, 3,000 at most) it dropped new ones at random, CANCELLED with no reason: a chief busy
    with a storm of 1,024 workers' calls lost a worker's plan call so (issue 31)."""
    import time

    from collective.transport.grpc.servicer import EventLoop

    calls = 2_500
    with grpc_link(chief_service(workers=1, timeouts=ROUND)) as link:
        assert link.status(timeout=10).phase == "joining"  # the server is up, its loop idle
        status = link._stub.Status
        EventLoop.get().call_soon_threadsafe(time.sleep, 2.0)  # the loop busy, as under a storm
        futures = [status.future(pb.StatusRequest(), timeout=120, metadata=((TOKEN_HEADER, TOKEN),))
                   for _ in range(calls)]
        codes: dict = {}
        for f in futures:
            try:
                f.result()
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
            codes[code] = codes.get(code, 0) + 1
    assert codes == {grpc.StatusCode.OK: calls}, codes


# --- issue 36 item 6: a refused request is freed when it is answered ---------------------------


def _held_requests(raw: bytes) -> int:
    """Decoded JoinRequests alive in this process, and bytes objects of ``raw``'s size other than it."""
    import gc

    joins = sum(type(o) is pb.JoinRequest for o in gc.get_objects())
    copies = {id(r) for o in gc.get_objects() for r in gc.get_referents(o)
              if type(r) is bytes and len(r) == len(raw) and r is not raw}
    return joins + len(copies)


def test_a_refused_large_join_is_freed_once_answered_not_at_a_later_collection():
    """Before, a refused call's request lived on until a full collection (seconds to minutes,
    and 720 MiB of a 16-Join storm 15 s later): gRPC keeps an aborted call's exception with
    the call's state, and its traceback held the handler's frames (the request) and the call's
    context (a cycle); and gRPC's receiver generator, suspended where it yielded the bytes, held
    them as long. With automatic collection off, nothing of three refused 2 MB Joins may stay."""
    import gc

    from collective.transport.grpc.admission import LARGE_REQUEST
    from tests.procs import wait_until

    endpoint = GrpcEndpoint("127.0.0.1:0", token=TOKEN)
    address = endpoint.start(chief_service(workers=2))
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
    declared = [pb.VariableInfo(name=f"layer{i}/kernel" + "x" * 60, shape=[4], dtype="<f4") for i in range(25_000)]
    raw = pb.JoinRequest(worker_id="y", incarnation="y", devices=["cpu:0"], declared=declared).SerializeToString()
    del declared
    assert len(raw) > LARGE_REQUEST
    join = channel.unary_unary(f"/{SERVICE}/Join")
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                join(raw, metadata=((TOKEN_HEADER, TOKEN),), timeout=60)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
            assert "declares 25000 variables" in info.value.details()
        wait_until(lambda: _held_requests(raw) == 0, "every refused request freed without a collection", timeout=10)
    finally:
        gc.enable()
        channel.close()
        endpoint.stop(0.5)


def test_a_join_refused_for_the_large_request_budget_is_tried_again_within_the_join_timeout():
    """Admission's RESOURCE_EXHAUSTED (too many large requests in flight at the chief) is back
    pressure, like a chief still loading: a worker's join tries again. Before, the worker
    failed at once with ResourceExhaustedError. A server that refuses the first Join so."""
    from concurrent import futures

    tries = []

    def join(request, context):
        tries.append(request.worker_id)
        if len(tries) == 1:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "Join a request of 2.0 MiB refused: ...; try again later")
        return pb.JoinReply(rank=0)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Join": grpc.unary_unary_rpc_method_handler(join, pb.JoinRequest.FromString, pb.JoinReply.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    link = GrpcChiefLink(f"127.0.0.1:{port}", token=TOKEN)
    try:
        reply = link.join(pb.JoinRequest(worker_id="w0"), timeout=60)
    finally:
        link.close()
        server.stop(0)
    assert reply.rank == 0 and tries == ["w0", "w0"], tries
