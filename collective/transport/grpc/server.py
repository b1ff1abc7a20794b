"""The gRPC server: the endpoint that serves a ``ChiefHandler`` (``servicer.py``) with the raw data port beside it."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import socket
from concurrent import futures

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc

from collective import errors as E
from collective.config import TlsFiles
from collective.limits import join_fields_limit
from collective.transport.api import ChiefEndpoint, ChiefHandler
from collective.transport.grpc.admission import BODY_TIMEOUT, RefusalLog, _Admission, _BodyWatch
from collective.transport.grpc.servicer import POOL_THREADS, EventLoop, Servicer
from collective.transport.grpc.tls import server_credentials
from collective.transport.grpc.wire import SERVER_OPTIONS, SERVICE

log = logging.getLogger(__name__)


# --- server ------------------------------------------------------------------------------


def _model_variables(handler) -> int:
    """How many variables the served model has: 0 while a chief bound first still loads it
    (``chief/pending.py`` stands in for the service until then)."""
    served = getattr(handler, "service", None) or handler
    return len(getattr(served, "specs", None) or ())


class GrpcEndpoint(ChiefEndpoint):
    """Serves ``handler`` on ``bind`` (``HOST:PORT``; port 0 picks a free one).

    Calls are coroutines on the process's event loop (``servicer.EventLoop``); the handler's
    logic runs on a pool of ``POOL_THREADS`` threads (``max_workers`` to change it), whatever the
    number of workers; calls that wait for the round are parked (``collective.parking``).
    ``name`` says who serves (chief, relay) in statuses and logs.
    """

    def __init__(
        self,
        bind: str,
        *,
        token: str | None = None,
        max_workers: int | None = None,
        tls: TlsFiles | None = None,
        name: str = "chief",
        body_timeout: float = BODY_TIMEOUT,
    ) -> None:
        self.bind = bind
        self.token = token
        self.tls = tls if tls is not None and tls.enabled else None
        self._credentials = server_credentials(self.tls) if self.tls else None  # refuse bad setups early
        self.max_workers = max_workers
        self.name = name
        self.body_timeout = body_timeout
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._data = None
        self._pool: futures.ThreadPoolExecutor | None = None
        self._health: health_async.HealthServicer | None = None
        self._refusals = RefusalLog()
        self._body: _BodyWatch | None = None

    def start(self, handler: ChiefHandler) -> str:
        _check_bindable(self.bind)
        self.max_workers = self.max_workers or POOL_THREADS
        self._warn_if_open()
        self._body = _BodyWatch(self.body_timeout, self._refusals)
        self._pool = futures.ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix=f"{self.name}-rpc")
        bind_identity = bool(self.tls and self.tls.has("ca"))
        servicer = Servicer(handler, self._pool, bind_identity=bind_identity, name=self.name)
        self._data = self._data_server(handler, bind_identity)
        port_answer = f"{self._data.port} {self._data.unix_name or ''}".strip().encode() if self._data else b""
        admission = _Admission(self.token, self._refusals, self._body, offload=servicer.offload,
                               fields={"Join": lambda: join_fields_limit(_model_variables(handler))})
        try:
            port = EventLoop.run(self._serve(servicer.handlers(admission, port_answer)), timeout=60.0)
        except RuntimeError as exc:
            self._close_beside()
            raise E.UsageError(f"cannot listen on {self.bind}: {exc}; is the port in use?") from exc
        if not port:
            self._close_beside()
            raise E.UsageError(f"cannot listen on {self.bind}: the port is in use or the address is not local")
        self.port = port
        host = self.bind.rpartition(":")[0]
        return f"{host}:{port}"

    async def _serve(self, handlers) -> int:
        """On the loop: the server with ``handlers`` and the health service, listening; its port (0: none)."""
        server = grpc.aio.server(options=SERVER_OPTIONS)
        server.add_generic_rpc_handlers((handlers,))
        self._health = health_async.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        port = self._add_port(server)
        if not port:
            return 0
        self._server = server  # before start: a Ctrl-C landing in start still leaves stop() a server to stop
        await server.start()
        for name in ("", SERVICE):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return port

    def _add_port(self, server, tries: int = 5) -> int:
        """Listen on ``bind``. A port this process picked free on every address may be taken before
        gRPC binds it (another server of this process picking at once: the relays of many workers
        in one process); then another is picked."""
        for attempt in range(tries):
            address = _same_port_everywhere(self.bind)
            try:
                if self._credentials is not None:
                    return server.add_secure_port(address, self._credentials)
                return server.add_insecure_port(address)
            except RuntimeError:
                if address == self.bind or attempt == tries - 1:
                    raise
        return 0

    async def _stop(self, grace: float) -> None:
        if self._health is not None:
            await self._health.enter_graceful_shutdown()  # NOT_SERVING for every service
        if self._server is not None:
            await self._server.stop(grace)

    def _close_beside(self) -> None:
        if self._data is not None:
            self._data.close()
            self._data = None
        self._body.close()

    def _warn_if_open(self) -> None:
        """Anyone who can reach a non-loopback address may join a server without a token."""
        host = self.bind.rpartition(":")[0].strip("[]")
        if self.token or is_loopback(host):
            return
        log.warning(
            "the %s listens on %s WITHOUT a cluster token: anyone who can reach this address can join "
            "and read the model; set COLLECTIVE_TOKEN (or --token) or bind 127.0.0.1", self.name, self.bind,
        )

    def _data_server(self, handler: ChiefHandler, bind_identity: bool):
        """The raw TCP data path beside this server (None with COLLECTIVE_DATA_PATH=grpc)."""
        from collective.transport import rawtcp

        if not rawtcp.enabled():
            return None
        try:
            return rawtcp.DataServer(
                self.bind.rpartition(":")[0], handler, token=self.token,
                tls=rawtcp.server_context(self.tls) if self.tls else None,
                identities=rawtcp.certificate_names if bind_identity else None, refused=self._refusals.refused,
            )
        except OSError as exc:  # the stream still works, over gRPC
            log.warning("no raw data port on %s (%s): workers receive over gRPC", self.bind, exc)
            return None

    def stop(self, grace: float) -> None:
        if getattr(self, "_data", None) is not None:
            self._data.close()
            self._data = None
        if self._server is not None:
            with contextlib.suppress(Exception):  # stopping: a loop that is gone has nothing left to serve
                EventLoop.run(self._stop(grace), timeout=grace + 2.0)
            self._server = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)  # grpc does not own its pool
            self._pool = None
        if self._body is not None:
            self._body.close()
            self._body = None
        self._refusals.flush()


def _check_bindable(bind: str) -> None:
    """Bind ``bind`` once with a plain socket, as gRPC is about to, so a port in use or an
    address not on this host is one line naming it (gRPC's own failure prints a C-core log line
    and a message that points at GRPC_VERBOSITY). Port 0 and names that do not resolve are left
    to gRPC."""
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit() or int(port) == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return
    for family, kind, proto, _, address in infos[:1]:  # gRPC binds the first (dual-stack for ::)
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT is no obstacle
            try:
                probe.bind(address)
            except OSError as exc:
                why = {errno.EADDRINUSE: "the port is in use (another chief or relay?); pick another port or stop that process",
                       errno.EADDRNOTAVAIL: "that address is not on this host; bind one of its addresses or 0.0.0.0",
                       errno.EACCES: "permission denied (ports below 1024 need privileges); pick a port above 1023"}
                raise E.UsageError(f"cannot listen on {bind}: {why.get(exc.errno, exc.strerror or str(exc))}") from None


def _same_port_everywhere(bind: str, tries: int = 50, first: tuple[int, ...] = ()) -> str:
    """``bind``, or for port 0 on a name with several addresses (``localhost``: 127.0.0.1 and
    ::1) ``host:P`` with a port P free on every one of them.

    gRPC binds such a name by taking a free port on the first address and then the same port on
    the others; when another process holds that port on one of them, gRPC only warns and serves
    on the rest, and a peer dialling that address reaches the other process (seen under load:
    a chain's child connected to a stranger where its relay should have been). ``first``:
    ports to try before free ones the kernel picks (for tests)."""
    host, _, port = bind.rpartition(":")
    if port != "0":
        return bind
    if host == "localhost":  # gRPC's own rule, whatever /etc/hosts says: both loopbacks
        addresses = [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")]
    else:
        try:
            infos = socket.getaddrinfo(host.strip("[]") or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except OSError:
            return bind
        addresses = list(dict.fromkeys((family, address[0]) for family, _, _, _, address in infos))
    if len(addresses) < 2:
        return bind
    for candidate in (*first, *([0] * tries)):
        probes: list[socket.socket] = []
        try:
            for family, address in addresses:
                try:
                    probe = socket.socket(family, socket.SOCK_STREAM)
                except OSError:  # no such family here (no IPv6): gRPC will not bind it either
                    continue
                probes.append(probe)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    probe.bind((address, probes[0].getsockname()[1] if len(probes) > 1 else candidate))
                except OSError as exc:
                    if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) and len(probes) > 1:
                        continue  # an address this host lacks (::1 without IPv6)
                    raise
            return f"{host}:{probes[0].getsockname()[1]}"
        except OSError:
            continue  # that port is taken on one of the addresses: another one
        finally:
            for probe in probes:
                probe.close()
    return bind


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``: addresses no other host can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
