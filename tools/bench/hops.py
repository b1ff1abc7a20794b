"""``collective bench hops``: the relay's own cost per hop, on this machine, without emulation.

A chain of ``--workers`` K relays (real processes, each the data plane's own code: a
``RelayHandler`` serving ``rawtcp.DataServer``, a ``Receiver`` fed by ``rawtcp.receive``, each
chunk forwarded once it has landed, verified) behind a source that serves a model of ``--size``
bytes cut at ``--chunk-bytes``. No chief, no gRPC control plane, no ready reports: every node
writes the time (CLOCK_MONOTONIC, one clock for every process of the machine) each chunk landed
there, and the source the time it released the first chunk. With a model of one chunk only one
process is busy at a time, so the time from the source's release to the chunk's landing at node
k, against k, is a line whose slope is the whole cost of one hop on a link as fast as the
machine's loopback: the bytes through the kernel, the digest, the hand-off to the relay's stream,
the wake-ups. The table gives that slope (least squares over k = 1..K, per round, then the
median of ``--repeat`` rounds) and each node's arrival.

Connections are opened and every stream asked for before the source releases its first chunk,
as in a round, where every worker asks its parent once prepared. ``--data-path tcp`` (default
here: what another host's link would take) or ``auto`` (an abstract unix socket on one host).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from collective import errors as E
from collective._proto import collective_pb2 as pb
from collective.digest import bytes_digest, chunk_digests
from collective.sizes import parse_size
from collective.stream import Receiver, new_arena
from collective.transport import rawtcp
from collective.worker.relay import RelayHandler
from tools.bench.spec import DEFAULT_SIZE, _positive, parse_workers

STALL = 30.0  # seconds without a byte before a node gives up: a broken run ends, a slow one is never cut


def make_plan(size: int, chunk: int, workers: int) -> tuple[pb.Plan, np.ndarray]:
    """A chain plan of one variable of ``size`` seeded bytes, and the source's arena."""
    arena = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    plan = pb.Plan(total_bytes=size, chunk_bytes=chunk, topology="chain", num_workers=workers,
                   chunk_digests=chunk_digests(memoryview(arena), chunk), manifest_digest="hops")
    plan.groups.add(group_key=1)
    plan.variables.add(name="v", dtype="uint8", shape=[size], group_key=1, instance_key=1, offset=0, nbytes=size,
                       digest=bytes_digest(memoryview(arena)))
    for r in range(workers):
        plan.workers.add(rank=r, worker_id=f"n{r + 1}", parent=r - 1)
    return plan, arena


class _Timed:
    """A Receiver's whole stream that notes when each chunk landed and wakes the relay (what
    the worker's ``_Watched`` does, without the heartbeat bookkeeping)."""

    def __init__(self, receiver: Receiver, relay: RelayHandler) -> None:
        self._r, self._relay = receiver, relay
        self.times: list[float] = []

    def view(self, offset: int, nbytes: int):
        return self._r.view(offset, nbytes)

    @property
    def bytes_received(self) -> int:
        return self._r.bytes_received

    def accept(self, chunk: pb.Chunk, *, placed: bool = False) -> None:
        self._r.accept(chunk, placed=placed)
        if chunk.offset < self._r.plan.total_bytes:
            self.times.append(time.monotonic())
        self._relay.progress()


def node(index: int, workers: int, size: int, chunk: int, tcp: bool) -> None:
    """One process of the chain (0: the source), driven by lines on stdin (see ``run_hops``)."""
    plan, source = make_plan(size, chunk, workers)
    handler = RelayHandler(STALL)
    server = rawtcp.DataServer("127.0.0.1", handler, token=None)
    print(f"port {server.port} {server.unix_name or '-'}", flush=True)
    upstream: tuple[int, str | None] | None = None
    go = threading.Event()
    timed: _Timed | None = None
    receiving: threading.Thread | None = None
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "up":
            upstream = int(rest[0]), None if tcp or rest[1] == "-" else rest[1]
        elif cmd == "prep":
            if index == 0:
                go.clear()
                handler.feed(plan, source, landed=lambda i: go.is_set())
            else:
                arena = new_arena(size)
                receiver = Receiver(plan, arena)
                timed = _Timed(receiver, handler)
                handler.feed(plan, arena, known=receiver.verified, landed=receiver.landed_mask.__getitem__)
            print("ready", flush=True)
        elif cmd == "connect":
            assert upstream is not None and timed is not None
            receiving = threading.Thread(target=_receive, args=(index, upstream, timed), daemon=True)
            receiving.start()
        elif cmd == "go":
            t0 = time.monotonic()
            go.set()
            handler.progress()
            print(json.dumps({"t0": t0}), flush=True)
        elif cmd == "wait":
            assert receiving is not None and timed is not None
            receiving.join(STALL * 2)
            print(json.dumps({"times": timed.times}), flush=True)
        elif cmd == "quit":
            break
    server.close()


def _receive(index: int, upstream: tuple[int, str | None], timed: _Timed) -> None:
    port, unix = upstream
    sock = rawtcp.connect("127.0.0.1", port, timeout=STALL, tls=None, server_name=None, unix_name=unix)
    rawtcp.receive(sock, pb.WorkerRef(worker_id=f"n{index}"), None, timed, stall_timeout=STALL,
                   track=lambda c: None, untrack=lambda c: None,
                   fail=lambda code, info, message: E.ProtocolError(f"node {index - 1}: {code} {message}"))


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def run_hops(args, say) -> int:
    """Start the chain, run ``--repeat`` rounds, print the per-hop slope (or one JSON line)."""
    workers = max(parse_workers(args.workers or ["8"]))
    if workers < 2:
        raise E.UsageError("collective bench hops needs --workers 2 or more (the slope of a chain)")
    chunk = parse_size(args.chunk_bytes or "512KiB", option="--chunk-bytes")
    # The bench's default size (a broadcast's) means one chunk here: one process busy at a time.
    size = chunk if args.size == DEFAULT_SIZE else parse_size(args.size)
    repeat = _positive(args.repeat, "--repeat")
    path = getattr(args, "data_path", None) or "tcp"
    if path not in ("tcp", "auto"):
        raise E.UsageError(f"collective bench hops --data-path {path!r}: use tcp (TCP on loopback) or auto (unix socket)")
    tcp = path == "tcp"
    argv = [sys.executable, "-m", "tools.bench.hops"]
    procs = [subprocess.Popen([*argv, str(i), str(workers), str(size), str(chunk), "tcp" if tcp else "auto"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(workers + 1)]
    try:
        return _rounds(procs, workers, size, chunk, repeat, tcp, args, say)
    finally:
        for p in procs:
            try:
                p.stdin.write("quit\n")
                p.stdin.flush()
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def _rounds(procs, workers, size, chunk, repeat, tcp, args, say) -> int:
    def send(p, line: str) -> None:
        p.stdin.write(line + "\n")
        p.stdin.flush()

    def answer(p) -> str:
        line = p.stdout.readline()
        if not line:
            raise E.CollectiveError(f"a node of the chain (pid {p.pid}) ended early; see its output above")
        return line

    ports = [answer(p).split()[1:] for p in procs]
    for i in range(1, len(procs)):
        send(procs[i], f"up {' '.join(ports[i - 1])}")
    slopes, arrivals = [], []
    for r in range(repeat):
        for p in procs:
            send(p, "prep")
        for p in procs:
            answer(p)
        for p in procs[1:]:
            send(p, "connect")
        time.sleep(0.3)  # every stream asked for before the first chunk is released
        send(procs[0], "go")
        t0 = json.loads(answer(procs[0]))["t0"]
        last = []
        for k, p in enumerate(procs[1:], 1):
            send(p, "wait")
            times = json.loads(answer(p))["times"]
            if len(times) != -(-size // chunk):
                raise E.CollectiveError(f"node {k} of the chain landed {len(times)} of {-(-size // chunk)} chunks "
                                        f"within {STALL * 2:g} s; see its output above")
            last.append(times[-1] - t0)
        arrivals.append(last)
        slopes.append(slope(list(range(1, workers + 1)), last))
        say(f"round {r + 1}: per hop {slopes[-1] * 1e3:.3f} ms")
    hop = statistics.median(slopes)
    median_arrival = [statistics.median(a[k] for a in arrivals) for k in range(workers)]
    if args.json:
        print(json.dumps({"hop_seconds": hop, "hop_samples": slopes, "arrival_seconds": median_arrival,
                          "workers": workers, "bytes": size, "chunk_bytes": chunk, "path": "tcp" if tcp else "unix"}))
        return 0
    print(f"chain of {workers} relays, {size} bytes in chunks of {chunk}, {'TCP on loopback' if tcp else 'unix socket'}")
    print("node  last chunk landed after the source released the first (ms, median of rounds)")
    for k, a in enumerate(median_arrival, 1):
        print(f"{k:>4}  {a * 1e3:8.3f}")
    print(f"per hop (slope, median of {repeat} rounds): {hop * 1e3:.3f} ms; rounds "
          + ", ".join(f"{s * 1e3:.3f}" for s in slopes))
    return 0


if __name__ == "__main__":
    node(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "tcp")
