"""``collective bench hops``: the relay's own cost per hop, on this machine, without emulation.

A chain (or, with ``--topology dtree``, a double tree) of ``--workers`` K relays, real processes,
each the data plane's own code: a ``RelayHandler`` serving ``rawtcp.DataServer``, a ``Receiver``
fed by ``rawtcp.receive`` (a double tree's two streams, one per tree, each from that tree's
parent), each chunk forwarded once it has landed, verified. The source serves a model of
``--size`` bytes cut at ``--chunk-bytes``. No chief, no gRPC control plane, no ready reports:
every node notes the time (CLOCK_MONOTONIC, one clock for every process of the machine) each
chunk landed there, and the source the time it released the chunks. With a model of one chunk
per tree only one process per tree is busy at a time, so the time from the release to a chunk's
landing at a node, against the node's hops from the source in the chunk's tree, is a line whose
slope is the whole cost of one hop on a link as fast as the machine's loopback: the bytes through
the kernel, the digest, the hand-off to the relay's stream, the wake-ups. The table gives that
slope (least squares over every node, per round, then the median of ``--repeat`` rounds).

Connections are opened and every stream asked for before the source releases its chunks, as in
a round, where every worker asks its parents once prepared. ``--data-path tcp`` (default here:
what another host's link would take) or ``auto`` (an abstract unix socket on one host).
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
from collective.arena import new_arena
from collective.bench.spec import DEFAULT_SIZE, _positive, parse_workers
from collective.digest import bytes_digest, chunk_digests
from collective.sizes import parse_size
from collective.stream import ChunkRange, Receiver
from collective.topology import top_down, trees
from collective.transport import rawtcp
from collective.worker.relay import RelayHandler

STALL = 30.0  # seconds without a byte before a node gives up: a broken run ends, a slow one is never cut
TOPOLOGIES = ("chain", "dtree")


def make_plan(size: int, chunk: int, workers: int, topology: str = "chain") -> tuple[pb.Plan, np.ndarray]:
    """A plan of one variable of ``size`` seeded bytes laid out as ``topology``, and the source's arena."""
    arena = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    plan = pb.Plan(total_bytes=size, chunk_bytes=chunk, topology=topology, num_workers=workers,
                   chunk_digests=chunk_digests(memoryview(arena), chunk), manifest_digest="hops")
    plan.groups.add(group_key=1)
    plan.variables.add(name="v", dtype="uint8", shape=[size], group_key=1, instance_key=1, offset=0, nbytes=size,
                       digest=bytes_digest(memoryview(arena)))
    layout = trees(topology, workers)
    for r in range(workers):
        w = plan.workers.add(rank=r, worker_id=f"n{r + 1}", parent=layout[0][r])
        if len(layout) > 1:
            w.parent_b = layout[1][r]
    return plan, arena


class _Timed:
    """One stream of a Receiver that notes when each chunk landed and wakes the relay (what the
    worker's ``_Watched`` does, without the heartbeat bookkeeping)."""

    def __init__(self, receiver: Receiver, rng: ChunkRange, relay: RelayHandler, times: dict[int, float]) -> None:
        self._r, self._relay, self.times = receiver.part(rng), relay, times
        self._total, self._chunk = receiver.plan.total_bytes, receiver.plan.chunk_bytes

    def view(self, offset: int, nbytes: int):
        return self._r.view(offset, nbytes)

    @property
    def bytes_received(self) -> int:
        return self._r.bytes_received

    def accept(self, chunk: pb.Chunk, *, placed: bool = False) -> None:
        self._r.accept(chunk, placed=placed)
        if chunk.offset < self._total:
            self.times[chunk.offset // self._chunk] = time.monotonic()
        self._relay.progress()


def node(index: int, workers: int, size: int, chunk: int, tcp: bool, topology: str) -> None:
    """One process (0: the source; k: worker rank k-1), driven by lines on stdin (``run_hops``)."""
    plan, source = make_plan(size, chunk, workers, topology)
    handler = RelayHandler(STALL)
    server = rawtcp.DataServer("127.0.0.1", handler, token=None)
    print(f"port {server.port} {server.unix_name or '-'}", flush=True)
    upstream: dict[int, tuple[int, str | None]] = {}  # by tree: the parent's port and unix socket name
    go = threading.Event()
    parts: list[_Timed] = []
    times: dict[int, float] = {}
    threads: list[threading.Thread] = []
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "up":
            upstream[int(rest[0])] = int(rest[1]), None if tcp or rest[2] == "-" else rest[2]
        elif cmd == "prep":
            if index == 0:
                go.clear()
                handler.feed(plan, source, landed=lambda i: go.is_set())
            else:
                arena = new_arena(size)
                receiver = Receiver(plan, arena)
                times = {}
                stride = len(upstream)
                parts = [_Timed(receiver, ChunkRange(stride=stride, phase=t), handler, times) for t in sorted(upstream)]
                handler.feed(plan, arena, known=receiver.verified, landed=receiver.landed_mask.__getitem__)
            print("ready", flush=True)
        elif cmd == "connect":
            threads = [threading.Thread(target=_receive, args=(index, upstream[t], part), daemon=True)
                       for t, part in zip(sorted(upstream), parts, strict=True)]
            for t in threads:
                t.start()
        elif cmd == "go":
            t0 = time.monotonic()
            go.set()
            handler.progress()
            print(json.dumps({"t0": t0}), flush=True)
        elif cmd == "wait":
            for t in threads:
                t.join(STALL * 2)
            print(json.dumps({"times": {str(i): t for i, t in times.items()}}), flush=True)
        elif cmd == "quit":
            break
    server.close()


def _receive(index: int, upstream: tuple[int, str | None], part: _Timed) -> None:
    port, unix = upstream
    sock = rawtcp.connect("127.0.0.1", port, timeout=STALL, tls=None, server_name=None, unix_name=unix)
    ref = part._r.range.ask(pb.WorkerRef(worker_id=f"n{index}"))
    rawtcp.receive(sock, ref, None, part, stall_timeout=STALL, track=lambda c: None, untrack=lambda c: None,
                   fail=lambda code, info, message: E.ProtocolError(f"node {index}'s parent: {code} {message}"))


def depths(ps: list[int]) -> list[int]:
    """Each receiver's hops from the source in one tree (parents ``ps``): 1 for the source's children."""
    out = [0] * len(ps)
    for r in top_down(ps):
        out[r] = 1 if ps[r] < 0 else out[ps[r]] + 1
    return out


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def run_hops(args, say) -> int:
    """Start the layout, run ``--repeat`` rounds, print the per-hop slope (or one JSON line)."""
    workers = max(parse_workers(args.workers or ["8"]))
    if workers < 2:
        raise E.UsageError("collective bench hops needs --workers 2 or more (the slope of a chain)")
    topology = (args.topology or ["chain"])[-1]
    if topology not in TOPOLOGIES:
        raise E.UsageError(f"collective bench hops --topology {topology!r}: use chain or dtree")
    chunk = parse_size(args.chunk_bytes or "512KiB", option="--chunk-bytes")
    # The bench's default size (a broadcast's) means one chunk per tree: one process busy at a time in each.
    size = chunk * len(trees(topology, workers)) if args.size == DEFAULT_SIZE else parse_size(args.size)
    repeat = _positive(args.repeat, "--repeat")
    path = getattr(args, "data_path", None) or "tcp"
    if path not in ("tcp", "auto"):
        raise E.UsageError(f"collective bench hops --data-path {path!r}: use tcp (TCP on loopback) or auto (unix socket)")
    argv = [sys.executable, "-m", "collective.bench.hops"]
    procs = [subprocess.Popen([*argv, str(i), str(workers), str(size), str(chunk), path, topology],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(workers + 1)]
    try:
        return _rounds(procs, topology, workers, size, chunk, repeat, path, args, say)
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


def _rounds(procs, topology, workers, size, chunk, repeat, path, args, say) -> int:
    def send(p, line: str) -> None:
        p.stdin.write(line + "\n")
        p.stdin.flush()

    def answer(p) -> str:
        line = p.stdout.readline()
        if not line:
            raise E.CollectiveError(f"a node (pid {p.pid}) ended early; see its output above")
        return line

    layout = trees(topology, workers)
    hops = [depths(ps) for ps in layout]  # by tree: each receiver's hops from the source
    chunks = -(-size // chunk)
    ports = [answer(p).split()[1:] for p in procs]
    for r in range(workers):
        for t, ps in enumerate(layout):
            send(procs[r + 1], f"up {t} {' '.join(ports[ps[r] + 1])}")
    slopes, arrivals = [], []
    for n in range(repeat):
        for p in procs:
            send(p, "prep")
        for p in procs:
            answer(p)
        for p in procs[1:]:
            send(p, "connect")
        time.sleep(0.3)  # every stream asked for before the first chunk is released
        send(procs[0], "go")
        t0 = json.loads(answer(procs[0]))["t0"]
        xs, ys, last = [], [], []
        for r, p in enumerate(procs[1:]):
            send(p, "wait")
            times = {int(i): t - t0 for i, t in json.loads(answer(p))["times"].items()}
            if len(times) != chunks:
                raise E.CollectiveError(f"node {r + 1} landed {len(times)} of {chunks} chunks within {STALL * 2:g} s")
            for i, t in times.items():  # the first chunk each tree carries: one process busy at a time
                if i < len(layout):
                    xs.append(hops[i % len(layout)][r])
                    ys.append(t)
            last.append(max(times.values()))
        arrivals.append(last)
        slopes.append(slope(xs, ys))
        say(f"round {n + 1}: per hop {slopes[-1] * 1e3:.3f} ms")
    hop = statistics.median(slopes)
    median_arrival = [statistics.median(a[k] for a in arrivals) for k in range(workers)]
    if args.json:
        print(json.dumps({"topology": topology, "hop_seconds": hop, "hop_samples": slopes,
                          "arrival_seconds": median_arrival, "workers": workers, "bytes": size, "chunk_bytes": chunk,
                          "path": "tcp" if path == "tcp" else "unix"}))
        return 0
    print(f"{topology} of {workers} relays, {size} bytes in chunks of {chunk}, "
          f"{'TCP on loopback' if path == 'tcp' else 'unix socket'}")
    print("rank  hops  last chunk landed after the source released them (ms, median of rounds)")
    for r, a in enumerate(median_arrival):
        print(f"{r:>4}  {'/'.join(str(h[r]) for h in hops):>4}  {a * 1e3:8.3f}")
    print(f"per hop (slope of each tree's first chunk over its hops, median of {repeat} rounds): {hop * 1e3:.3f} ms; "
          "rounds " + ", ".join(f"{s * 1e3:.3f}" for s in slopes))
    return 0


if __name__ == "__main__":
    node(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "tcp", sys.argv[6])
