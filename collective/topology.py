"""Who receives from whom: star, binomial tree, pipelined chain, laid out by host.

Nodes are numbered 0 (the chief) and 1..N (worker rank r is node r+1). ``parents`` returns, for
every worker rank, the rank it receives from, or -1 for the chief.

- star: every worker streams from the chief. The chief's link carries N copies: about N x S/B.
- tree: binomial tree; node k receives from k - 2**floor(log2 k). Each node relays every chunk as
  soon as it has landed, but the chief's link carries one copy per child: ceil(log2(N+1)) x S/B.
- chain: node k receives from k-1 and relays each chunk onwards as soon as it has arrived, so
  every link carries the model once and the total is about S/B plus one chunk per hop.

``arrange`` lays these out over hosts (known from each worker's join), so that each host's
network link carries the model once:

- with sharing (the chief offers its arena through shared memory), workers on the chief's host
  map the chief's arena; on every other host the lowest rank (the host's *leader*) receives from
  the network and the others there receive from it, mapping its arena (``transport.shm``). Only
  the leaders form the star, tree or chain.
- without sharing, every worker receives from the network, the topology running over the workers
  ordered by host (the chief's host first), so a chain enters and leaves each host once.
- when every network receiver is on the chief's own host (one machine, ``--no-shm``), no network
  link is shared: each stream is a memory copy through the kernel, and a relay hop only adds a
  receive, a forward and a wake-up per chunk. ``auto`` then takes a star, up to
  ``SAME_HOST_STAR_MAX`` receivers, a tree beyond (one machine, 2 cores, 256 MiB, BENCHMARKS.md:
  4 workers star 0.34 s, tree 0.41 s, chain 0.56 s; 8 workers 0.71, 0.78, 1.16 s).

- dtree (``dtree_parents``): NCCL's pipelined double binary tree over the receivers. Two binary
  trees, each rooted at the chief, each carrying every other chunk (``carrier``); every receiver
  is an interior node (at most two children) of at most one of them, so every uplink carries the
  model at most once (plus one chunk when their number is odd) and a chunk crosses at most
  ceil(log2(N+1)) + 1 hops. A receiver takes each tree's chunks from that tree's parent
  (``Layout.parents_b``, the plan's ``WorkerInfo.parent_b``) in two streams at once, and relays
  each chunk as it lands; the simulator (collective/bench/sim.py) runs it chunk by chunk.

``choose`` resolves ``auto`` with ``predict``, a model of the broadcast time fitted to runs on
emulated hosts (BENCHMARKS.md): the topology with the least predicted time for this number of
network receivers and this payload, on a link of ``ASSUMED_LINK_BPS``. Small payloads are
latency-bound (few hops: tree, or star for one or two receivers); large ones bandwidth-bound
(chain). A star never wins for two or more receivers of a large payload: it costs the chief's
link one copy per receiver.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from collective.errors import UsageError
from collective.plan import DEFAULT_CHUNK_BYTES

# What users can pick, and ``auto`` among them.
TOPOLOGIES = ("auto", "star", "tree", "chain", "dtree")
# Default chunk size of a chain (an explicit --chunk-bytes wins): the pipeline fills one chunk
# per hop, so 8 workers at 200 Mbit/s took 1.73x S/B with 4 MiB chunks and 1.12x with 512 KiB.
CHAIN_CHUNK_BYTES = 512 << 10
# What ``auto`` assumes of the links it cannot see: a fast datacentre link (bytes per second).
# A faster link makes per-hop latency weigh more, so it is the assumption that favours the chain
# least; on slower links the chain only gains.
ASSUMED_LINK_BPS = 25e9 / 8
# Per hop beyond its chunk (a relay's stream setup, receiving, checking and forwarding), seconds.
# Measured (BENCHMARKS.md): 0.41 ms for a relay with a core to itself (`collective bench hops`,
# one chunk through a chain on loopback), 2.5-3.8 ms with every relay of a pipelined stream busy on
# 2 shared cores, 2.6-3.3 ms fitted to emulated hosts, whose relays share 2 cores too. 2 ms sits
# between: a relay on a host whose cores the training job also wants.
HOP_SECONDS = 0.002
# What ``auto`` multiplies a topology's prediction by, for what the model leaves out. The double
# tree's emulated runs (16 MiB at 2-16 hosts, 64 MiB at 8, BENCHMARKS.md) took up to 1.08x its
# prediction once the model stopped giving a token bucket's head start to a downlink fed by two
# senders (up to 1.14x before, which set 1.15 here; 1.4x before ``stream.Lockstep``).
UNMODELLED = {"dtree": 1.08}
# On the chief's own host (no shared network link), ``auto`` streams to at most this many
# receivers straight from the chief, and builds a tree for more (bounding the chief's streams).
SAME_HOST_STAR_MAX = 8


def parents(topology: str, workers: int) -> list[int]:
    if topology == "star":
        return [-1] * workers
    if topology == "chain":
        return [r - 1 for r in range(workers)]  # rank 0 from the chief, r from r-1
    if topology == "dtree":
        return dtree_parents(workers)[0]  # tree A; ``trees`` gives both
    if topology == "tree":
        out = []
        for r in range(workers):
            node = r + 1
            parent_node = node - (1 << (node.bit_length() - 1))
            out.append(parent_node - 1)
        return out
    raise UsageError(f"unknown topology {topology!r}; use one of {', '.join(TOPOLOGIES)}")


# Laid out by ``trees`` and modelled by ``predict`` and the simulator: every one users can pick.
MODELLED = TOPOLOGIES[1:]


def _btree(n: int, rank: int) -> int:
    """The parent of ``rank`` in NCCL's in-order binary tree over ranks 0..n-1 (-1: the root, rank
    0, whose one child is the largest power of two below n). A rank whose lowest set bit is b has
    children rank -+ b/2: odd ranks are leaves."""
    if rank == 0:
        return -1
    bit = rank & -rank
    up = (rank ^ bit) | (bit << 1)
    return rank ^ bit if up >= n else up


def dtree_parents(workers: int) -> tuple[list[int], list[int]]:
    """The parents (-1: the chief) of ``workers`` receivers in the two trees of a double binary
    tree. Tree B mirrors tree A (rank r -> n-1-r), so A's interior ranks (even) are B's leaves (odd
    ranks) and the other way round. An odd count gets a virtual rank 0, A's root (one child) and
    B's leaf, dropped afterwards: its child becomes A's root. (NCCL shifts an odd count by one
    instead, which leaves rank 0 interior in both trees: its uplink would carry 1.5 models.)"""
    if workers <= 0:
        return [], []
    if workers % 2:
        a, b = dtree_parents(workers + 1)
        return [max(p - 1, -1) for p in a[1:]], [max(p - 1, -1) for p in b[1:]]
    n = workers
    a = [_btree(n, r) for r in range(n)]
    b = [-1 if (u := _btree(n, n - 1 - r)) == -1 else n - 1 - u for r in range(n)]
    return a, b


def trees(topology: str, workers: int) -> list[list[int]]:
    """Every tree of ``topology`` as a parents list (-1: the chief): one, or two for dtree."""
    if topology == "dtree":
        return list(dtree_parents(workers))
    return [parents(topology, workers)]


def carrier(topology: str, chunk: int) -> int:
    """Which of ``trees(topology, N)`` carries chunk ``chunk``: a dtree alternates its two
    trees, so each carries half the chunks and the chief's uplink the model once."""
    return chunk % 2 if topology == "dtree" else 0


def chunk_bytes_for(topology: str) -> int:
    """The default chunk of a topology: small for a chain or a double tree, whose pipelines fill
    one chunk per hop."""
    return CHAIN_CHUNK_BYTES if topology in ("chain", "dtree") else DEFAULT_CHUNK_BYTES


def predict(
    topology: str, receivers: int, total_bytes: int, *, bytes_per_second: float = ASSUMED_LINK_BPS,
    hop_seconds: float = HOP_SECONDS, chunk_bytes: int | None = None, burst_bytes: int = 0,
) -> float:
    """Predicted broadcast seconds for ``receivers`` network receivers, one per host.

    The structure of the simulator (collective/bench/sim.py, which runs these layouts chunk by chunk):
    every parent-child pair is a stream with an equal share of the links it crosses, 1 / max(the
    parent's streams out, the child's streams in). The chief's link carries the model once per
    child of the chief in each tree (a star: once per receiver; a binomial tree: ceil(log2(R+1));
    a chain, or a double tree whose trees each carry half: once), which ends when the last chunk
    has left the chief. Then that chunk goes down the tree: every hop after the first takes one
    chunk at its stream's share (a chain: one chunk per hop; a double tree: two, each of its
    streams at half a link), and every hop adds ``hop_seconds``; the slowest receiver counts.
    ``burst_bytes``: a token bucket on every link (emulated links: tc tbf's), which refills while
    a relay's link waits for the next chunk: each hop is that much at the link's rate shorter (at
    most its chunk's time), or ``bucket_bytes`` of it into a receiver with two streams.
    """
    if receivers <= 0:
        return 0.0
    if topology not in MODELLED:
        parents(topology, 1)  # raises, naming the topologies users can pick
    chunk = min(chunk_bytes or chunk_bytes_for(topology), max(total_bytes, 1))
    # A tree that carries no chunk (a one-chunk model's second) opens no stream.
    layout = trees(topology, receivers)[: max(1, -(-total_bytes // chunk))]
    out = [0] * (receivers + 1)  # streams out of node p + 1 (node 0 the chief)
    into = [0] * receivers
    for ps in layout:
        for r, p in enumerate(ps):
            out[p + 1] += 1
            into[r] += 1
    chief_link = total_bytes / len(layout) * out[0] / bytes_per_second
    fill = 0.0
    for ps in layout:
        after = [0.0] * receivers  # seconds from the last chunk leaving the chief to it landing at r
        for r in top_down(ps):
            p = ps[r]
            share = max(out[p + 1], into[r])
            down = 0.0 if p < 0 else after[p] + chunk * share / bytes_per_second
            # The bucket lets at most the chunk itself through at once.
            after[r] = down + hop_seconds - min(bucket_bytes(burst_bytes, chunk, into[r]), chunk * share) / bytes_per_second
        fill = max(fill, max(after))
    return chief_link + fill


def bucket_bytes(burst: int, chunk: int, streams_in: int) -> int:
    """What of a link's token bucket (``burst`` bytes) a stream into a receiver can use on a hop:
    all of it when the stream has the receiver's downlink to itself; on a downlink fed by two
    senders (a double tree's receiver), the bucket less one ``chunk``, the other sender's chunk
    always in flight through it (emulated hosts, BENCHMARKS.md)."""
    return burst if streams_in <= 1 else max(0, burst - chunk)


def top_down(ps: Sequence[int]) -> list[int]:
    """The receivers of one tree (parents ``ps``), each after its parent."""
    kids: list[list[int]] = [[] for _ in range(len(ps) + 1)]
    for r, p in enumerate(ps):
        kids[p + 1].append(r)
    order, todo = [], list(kids[0])
    while todo:
        r = todo.pop()
        order.append(r)
        todo.extend(kids[r + 1])
    return order


def choose(topology: str, receivers: int, total_bytes: int, *, same_host: bool = False) -> str:
    """Resolve ``auto``: the topology with the least ``predict`` for ``receivers`` network
    receivers (workers that do not map a same-host arena) and ``total_bytes``; with
    ``same_host`` (every receiver on the chief's host), a star or, past ``SAME_HOST_STAR_MAX``
    receivers, a tree."""
    if topology != "auto":
        parents(topology, 1)  # validates the name
        return topology
    if same_host:
        return "star" if receivers <= SAME_HOST_STAR_MAX else "tree"
    # min keeps the first of equals: star, the simplest, for a single receiver.
    return min(TOPOLOGIES[1:], key=lambda t: predict(t, receivers, total_bytes) * UNMODELLED.get(t, 1.0))


@dataclass(frozen=True)
class Layout:
    """Who receives from whom. ``parents[r]``: the rank worker r receives from, -1 the chief.
    A worker whose parent is on its own host (or the chief, on the chief's host, with sharing)
    maps that parent's arena through shared memory when it can, else streams from it. A double
    tree's ``parents_b[r]``: whom r receives tree B's chunks from (``carrier``), None for a
    worker with one parent (one mapping its host leader's arena) and for every other topology."""

    topology: str
    parents: list[int]
    receivers: int  # workers that receive over the network (the leaders, with sharing)
    parents_b: list[int | None] | None = None


def arrange(topology: str, hosts: Sequence[str], chief_host: str, total_bytes: int, *, share: bool) -> Layout:
    """Lay ``topology`` (or ``auto``) out over workers on ``hosts`` (``hosts[r]``: worker r's host).

    Pure: see the module doc for the rules. Hosts keep the order of their lowest rank, the chief's
    host first, and ranks within a host their order.
    """
    order: dict[str, list[int]] = {chief_host: []}
    for r, h in enumerate(hosts):
        order.setdefault(h, []).append(r)
    out = [-1] * len(hosts)
    if share:
        groups = [ranks for h, ranks in order.items() if h != chief_host and ranks]
        # On the chief's host: the chief's own arena (parent -1), already set.
        net = [ranks[0] for ranks in groups]
        for ranks in groups:
            for r in ranks[1:]:
                out[r] = ranks[0]
    else:
        net = [r for ranks in order.values() for r in ranks]
    same_host = bool(net) and all(hosts[r] == chief_host for r in net)
    resolved = choose(topology, len(net), total_bytes, same_host=same_host)
    layers = trees(resolved, len(net))
    for i, p in enumerate(layers[0]):
        out[net[i]] = -1 if p < 0 else net[p]
    if len(layers) == 1:
        return Layout(resolved, out, len(net))
    out_b: list[int | None] = [None] * len(hosts)
    for i, p in enumerate(layers[1]):
        out_b[net[i]] = -1 if p < 0 else net[p]
    return Layout(resolved, out, len(net), out_b)
