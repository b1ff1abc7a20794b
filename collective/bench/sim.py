"""A chunk-level simulation of one broadcast over the project's own layouts: every chunk's send
and landing on every stream, with link rate, per-hop latency and per-chunk cost as inputs.

Who sends which chunk to whom comes from ``collective.topology`` (``trees``: the parents of every
receiver in each tree of a layout; ``carrier``: which tree carries chunk c), the chunks' sizes
from the plan's own chunking (``collective.stream.frame_messages`` of a plan of that many bytes
cut at ``chunk_bytes_for(topology)``). Nothing of either is re-implemented here.

The network (``Net``): every host (the chief, and one receiver per host) has one uplink and one
downlink of ``bytes_per_second`` each (full duplex), of which ``efficiency`` carries payload (tc's
tbf shapes whole frames: TCP/IP headers take about 4.5 %). Every parent-child pair is one stream
(as in the data plane: one per child, one per parent and tree), and a stream gets an equal share
of both links it crosses: 1 / max(streams out of the sender, streams into the receiver), as TCP
shares them. A stream sends its chunks one after the other, in order, each once it is ready at
the sender. A chunk lands ``hop_seconds`` after its last byte left; the receiver can forward it
(or count it) ``chunk_seconds`` later (receiving it, checking its digest, waking the relay). The
round ends when the last receiver holds its last chunk, plus ``fixed_seconds`` (the ready reports
and the round's own setup). The two per-hop inputs enter only as their sum. On emulated hosts, tbf's
bucket (``burst_bytes``, 256 KiB in ``emulate.shape``) refills while a link waits and lets that
many bytes through at once (``_bucketed``): a chain's hop takes less than a chunk at the shaped
rate. A downlink fed by two senders (a double tree's receiver, one stream per tree) always has
the other sender's current chunk in flight through it, which takes that much of the bucket: a
stream there gets the bucket less one chunk (``topology.bucket_bytes``; none of a 256 KiB bucket
with 512 KiB chunks). Giving it the whole bucket made the double tree's emulated runs 5-11 %
slower than simulated (about 11 ms per level); giving it none made runs with a 1 MiB bucket up
to 16 % faster than simulated, while a bucket less one chunk predicted those within 8.5 %.

Why shares and not one queue per uplink: a double tree's receiver takes alternate chunks from two
parents at once; served one chunk at a time, a sender whose child is taking a chunk from its other
parent waits, and such a simulation moved the double tree's chunks 1.35x slower than its links
allow, a gap that TCP, which runs both streams at half rate, does not have.

Each stream's chunk times are one running maximum (numpy), so 10 GiB in 512 KiB chunks over
10,000 hosts (2 x 10^8 chunk transfers) takes seconds, with no extrapolation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from collective._proto import collective_pb2 as pb
from collective.stream import frame_messages
from collective.topology import bucket_bytes, carrier, chunk_bytes_for, top_down, trees


@dataclass(frozen=True)
class Net:
    bytes_per_second: float
    efficiency: float = 1.0
    hop_seconds: float = 0.0
    chunk_seconds: float = 0.0
    fixed_seconds: float = 0.0
    burst_bytes: int = 0  # tc tbf's bucket: a stream's first bytes cross an idle shaped link at once


def chunk_sizes(total_bytes: int, chunk_bytes: int) -> list[int]:
    """The payload of every chunk of a plan of ``total_bytes`` cut at ``chunk_bytes``, as the
    chief's stream cuts it (the end message, which carries no bytes, left out)."""
    plan = pb.Plan(total_bytes=total_bytes, chunk_bytes=chunk_bytes)
    return [end - start for _msg, start, end in frame_messages(plan) if end > start]


def simulate(topology: str, receivers: int, total_bytes: int, net: Net, *, chunk_bytes: int | None = None) -> float:
    """Seconds from the chief's first byte until every one of ``receivers`` (one per host) holds
    every chunk, plus ``net.fixed_seconds``."""
    if receivers <= 0:
        return 0.0
    sizes = np.array(chunk_sizes(total_bytes, chunk_bytes or chunk_bytes_for(topology)), dtype=np.float64)
    layout = trees(topology, receivers)
    which = np.array([carrier(topology, c) for c in range(len(sizes))])
    # Streams (one per parent and child) out of each node and into each: every stream gets an
    # equal share of the links it crosses, as TCP shares them.
    out_deg = [0] * (receivers + 1)  # node 0 the chief, node r + 1 receiver r
    in_deg = [0] * (receivers + 1)
    for t, ps in enumerate(layout):
        if not (which == t).any():
            continue  # a tree that carries no chunk (a one-chunk model's second tree) opens no stream
        for r, p in enumerate(ps):
            out_deg[p + 1] += 1
            in_deg[r + 1] += 1
    rate = net.bytes_per_second * net.efficiency
    done = 0.0
    for t, ps in enumerate(layout):
        mine = sizes[which == t]
        if not len(mine):
            continue
        # Each stream is a FIFO over its chunks: chunk i leaves when it is ready at the sender and
        # the chunk before it has left; end_i = max(ready_i, end_{i-1}) + d_i, a running max.
        ready: dict[int, np.ndarray] = {-1: np.zeros(len(mine))}  # the chief holds every chunk
        waiting = Counter(ps)  # children still to compute: a parent's times are dropped after its last
        spans: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # by share: each chunk's seconds, and before it
        for r in top_down(ps):
            p = ps[r]
            share = max(out_deg[p + 1], in_deg[r + 1])
            if share not in spans:
                d = mine * (share / rate)
                spans[share] = (d, np.cumsum(d) - d)
            d, before = spans[share]
            # A downlink fed by two senders (a double tree's receiver) always has the other
            # sender's chunk in flight through its bucket: a stream there gets the rest.
            tokens = bucket_bytes(net.burst_bytes, int(mine[0]), in_deg[r + 1])
            if tokens:
                end = _bucketed(ready[p], d, tokens / rate)
            else:
                end = np.maximum.accumulate(ready[p] - before) + before + d
            waiting[p] -= 1
            if not waiting[p]:
                del ready[p]
            end += net.hop_seconds + net.chunk_seconds  # landed, checked: it counts and may go on
            done = max(done, float(end[-1]))
            if waiting[r]:
                ready[r] = end
    return done + net.fixed_seconds


def _bucketed(ready: np.ndarray, d: np.ndarray, bucket_seconds: float) -> np.ndarray:
    """The chunks' end times on one stream through tc's tbf: tokens gather while the link waits
    for a chunk, up to the bucket (in seconds of the stream's share: burst / k bytes at rate / k),
    and carry that many seconds of a chunk at once. A relay's link idles while the relay takes in
    the next chunk, so every hop of a chain fills up to one bucket faster than the shaped rate."""
    out = []
    tokens, last = bucket_seconds, 0.0
    for r, di in zip(ready.tolist(), d.tolist(), strict=True):  # plain floats: this loop is the fit's cost
        start = r if r > last else last
        tokens = min(bucket_seconds, tokens + start - last)
        used = min(tokens, di)
        tokens -= used
        last = start + di - used
        out.append(last)
    return np.array(out)

