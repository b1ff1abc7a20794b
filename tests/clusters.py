"""Building clusters for tests, in one place: small models, a chief service, and the three ways to
put workers beside it.

* ``inmemory_cluster``: the chief and its agents in this process over the in-memory transport,
  for the logic (unit tests).
* ``grpc_chief`` / ``grpc_round``: the chief in this process behind a real ``GrpcEndpoint`` on
  loopback, as a training script serving it through the Python API would; workers join over
  gRPC in threads.
* ``Cluster``: chief and worker processes (``python -m collective.chief|worker``), killed by pid
  when the test ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from collective._api import ArraysSource
from collective.config import Timeouts
from tests.procs import Proc, wait_for_file

# The chief-side fill path over given arrays, without files: the Python API's own source.
ArraySource = ArraysSource

FAST = Timeouts(join=5.0, straggler_log=1.0, rpc=5.0, stall=5.0, ready=10.0, start=10.0, linger=2.0)
# Over real gRPC on a machine that may be loaded: long enough never to fire in a passing test.
ROUND = Timeouts(join=30.0, straggler_log=5.0, rpc=10.0, stall=10.0, ready=20.0, start=20.0, linger=2.0)
TOKEN = "the-token"


def small_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "dense/kernel": rng.standard_normal((33, 17)).astype(np.float32),
        "dense/bias": np.zeros(17, np.float32),
        "embedding": rng.standard_normal((1000, 64)).astype(np.float16),
        "big_endian": np.arange(10, dtype=">i8"),
        "scalar": np.array(3.5),
        "empty": np.zeros((0, 3), np.float32),
        "global_step": np.array(0, np.int64),
    }


def run_threads(targets: Sequence, timeout: float = 30.0) -> list:
    """Run callables in threads; return their results or exceptions, in order."""
    results: list = [None] * len(targets)

    def wrap(i, fn):
        try:
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            results[i] = exc

    threads = [threading.Thread(target=wrap, args=(i, fn), daemon=True) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise AssertionError(f"thread did not finish within {timeout} s")
    return results


def chief_service(arrays: Mapping[str, np.ndarray] | None = None, workers: int = 1, *, timeouts: Timeouts = FAST,
                  chunk_bytes: int | None = 4096, **options):
    """A ``ChiefService`` over ``arrays`` (default ``small_arrays()``) for ``workers`` workers."""
    from collective.chief.service import ChiefService

    return ChiefService(ArraySource(small_arrays() if arrays is None else arrays), workers, timeouts=timeouts,
                        chunk_bytes=chunk_bytes, **options)


# --- in this process, over the in-memory transport -------------------------------------------------


def inmemory_endpoint(service):
    from collective.transport.inmemory import InMemoryEndpoint

    endpoint = InMemoryEndpoint()
    endpoint.start(service)
    return endpoint


def inmemory_cluster(arrays, devices_per_worker, timeouts=FAST, chunk_bytes=4096, *, names: str = "w{i}",
                     expected: Mapping[int, object] | None = None, **options):
    """A chief over ``arrays``, its in-memory endpoint, and one agent per device list (agent
    ``i`` named ``names.format(i=i, rank=i + 1)``, preferring rank ``i``, declaring
    ``expected[i]`` if given). ``options`` go to the ``ChiefService``."""
    from collective.worker.agent import WorkerAgent

    service = chief_service(arrays, len(devices_per_worker), timeouts=timeouts, chunk_bytes=chunk_bytes, **options)
    endpoint = inmemory_endpoint(service)
    agents = [
        WorkerAgent(endpoint.link(), worker_id=names.format(i=i, rank=i + 1), devices=devs, preferred_rank=i,
                    timeouts=timeouts, expected=(expected or {}).get(i))
        for i, devs in enumerate(devices_per_worker)
    ]
    return service, endpoint, agents


def flip_last_bit(link) -> None:
    """Make ``link`` (an in-memory link) flip the last bit of every chunk it receives."""
    real_fetch = link.fetch

    def flipped(ref, stall_timeout):
        for chunk in real_fetch(ref, stall_timeout):
            if chunk.data:
                data = bytearray(chunk.data)
                data[-1] ^= 0x01
                chunk.data = bytes(data)
            yield chunk

    link.fetch = flipped


# --- in this process, over real gRPC -----------------------------------------------------------------


@contextmanager
def grpc_chief(handler, *, token: str | None = TOKEN, bind: str = "127.0.0.1:0", **endpoint_options) -> Iterator[str]:
    """``handler`` (a ``ChiefService`` or a stand-in) served by a ``GrpcEndpoint`` on loopback;
    yields its address, then stops the endpoint and closes the service."""
    from collective.transport.grpc import GrpcEndpoint

    endpoint = GrpcEndpoint(bind, token=token, **endpoint_options)
    try:
        yield endpoint.start(handler)
    finally:
        endpoint.stop(grace=0.5)
        close = getattr(handler, "close", None)
        if close is not None:
            close()


@contextmanager
def grpc_link(handler, *, token: str | None = TOKEN, **endpoint_options):
    """``grpc_chief`` plus one ``GrpcChiefLink`` to it, closed after."""
    from collective.transport.grpc import GrpcChiefLink

    with grpc_chief(handler, token=token, **endpoint_options) as address:
        link = GrpcChiefLink(address, token=token)
        try:
            yield link
        finally:
            link.close()


def catch(fn):
    """``fn()``'s CollectiveError, or None when it returns."""
    from collective.errors import CollectiveError

    try:
        fn()
    except CollectiveError as exc:
        return exc
    return None


def grpc_round(n: int, *, token: str | None = TOKEN, before: Callable[[str], None] | None = None,
               timeouts: Timeouts = ROUND, **endpoint_options):
    """A chief on loopback with ``n`` workers joining through ``collective.join`` in threads;
    ``before(address)`` runs once the chief listens and before any worker starts. Returns
    (supervise's error or None, the workers' results)."""
    from collective._api import join as join_cluster

    service = chief_service(workers=n, timeouts=timeouts)
    with grpc_chief(service, token=token, **endpoint_options) as address:
        outcome: list = []
        supervisor = threading.Thread(target=lambda: outcome.append(catch(service.supervise)), daemon=True)
        supervisor.start()
        if before is not None:
            before(address)
        workers = [
            (lambda i=i: join_cluster(address, worker_id=f"w{i}", token=token, timeouts=timeouts))
            for i in range(n)
        ]
        results = run_threads(workers, timeout=90)
        supervisor.join(60)
        assert not supervisor.is_alive(), "supervise() did not return"
        return outcome[0], results


# --- processes ------------------------------------------------------------------------------------


class Cluster:
    """Start a chief and workers by hand; ``close`` kills whatever is still running.

    Every process gets ``--join-timeout JOIN_TIMEOUT`` unless its arguments name one: long
    enough for a loaded machine, short enough that a broken test fails within a minute."""

    JOIN_TIMEOUT = "60"

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []
        self.address = ""

    def chief(self, *args: str, env: dict[str, str] | None = None, wait_port: bool = True,
              wrapper: list[str] | None = None, code: str | None = None) -> Proc:
        """``code``: Python run with ``-c`` instead of ``-m collective.chief`` (a chief with a
        part replaced; it ends by calling ``collective.chief.__main__.main(sys.argv[1:])``)."""
        port_file = self.tmp / "chief.port"
        p = Proc([*(["-c", code] if code else ["-m", "collective.chief"]), "--bind", "127.0.0.1:0", "--port-file", str(port_file),
                  "--result-file", str(self.tmp / "result.json"), *self._defaults(args)], self.tmp / "chief.log", env,
                 wrapper=wrapper)
        self.procs.append(p)
        if wait_port:
            self.address = f"127.0.0.1:{wait_for_file(port_file, p)}"
        return p

    def worker(self, name: str, *args: str, chief: str | None = None, env: dict[str, str] | None = None,
               sigint_ignored: bool = False, code: str | None = None) -> Proc:
        """``code``: Python run with ``-c`` instead of ``-m collective.worker`` (a worker with a
        part replaced, e.g. ``SLOW_RECEIVER``; it ends by calling the worker's ``main``)."""
        log = self.tmp / f"{name}.log"
        n = 1
        while log.exists():  # a second process with the same id (a restart, a twin) gets its own log
            n += 1
            log = self.tmp / f"{name}-{n}.log"
        p = Proc([*(["-c", code] if code else ["-m", "collective.worker"]), "--chief", chief or self.address,
                  "--worker-id", name, *self._defaults(args)], log, env, sigint_ignored=sigint_ignored)
        self.procs.append(p)
        return p

    def _defaults(self, args: tuple[str, ...]) -> list[str]:
        given = any(a == "--join-timeout" or a.startswith("--join-timeout=") for a in args)
        return [*args] if given else [*args, "--join-timeout", self.JOIN_TIMEOUT]

    def close(self) -> None:
        for p in self.procs:
            p.kill()


def tampering_relay(*, forge_trailer: bool) -> str:
    """A worker process (``python -c`` this, then the worker's arguments) whose relay flips one
    bit of the first chunk it forwards, its own copy intact; with ``forge_trailer`` it also
    hashes the changed chunk again, so its trailer agrees with its bytes."""
    forge = "            msg.digest = xxhash.xxh3_128_hexdigest(data)\n" if forge_trailer else ""
    return (
        "import sys, xxhash\n"
        "from collective.worker import relay\n"
        "honest = relay.RelayHandler.stream_views\n"
        "def tampering(self, refs):\n"
        "    for i, (msg, data) in enumerate(honest(self, refs)):\n"
        "        if i == 0:\n"
        "            data = bytearray(data)\n"
        "            data[0] ^= 1\n"
        "            data = memoryview(bytes(data))\n"
        f"{forge}"
        "        yield msg, data\n"
        "relay.RelayHandler.stream_views = tampering\n"
        "from collective.worker.__main__ import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )


# A worker that takes its stream slowly: 5 ms per chunk, so transformer-100m in 64 KiB chunks
# (6,009 of them) takes 30 s or more. A test that freezes or kills a process "mid-broadcast"
# gives the receiver this, so the broadcast is still under way when its signal lands, however
# fast the data path (0.7 s for that model here) and however loaded the machine.
SLOW_RECEIVER = """
import sys, time
from collective import stream
real = stream.Part.accept  # every stream of a Receiver (a double tree's two)
def slow(self, chunk, placed=False):
    time.sleep(0.005)
    return real(self, chunk, placed=placed)
stream.Part.accept = slow
from collective.worker.__main__ import main
sys.exit(main(sys.argv[1:]))
"""
