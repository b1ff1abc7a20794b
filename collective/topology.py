"""Who receives from whom: star, binomial tree, pipelined chain.

Nodes are numbered 0 (the chief) and 1..N (worker rank r is node r+1). Each function returns,
for every worker rank, the rank it receives from, or -1 for the chief.

- star: every worker streams from the chief. The chief's link carries N copies: about N x S/B.
- tree: binomial tree; node k receives from k - 2**floor(log2 k). log2(N+1) rounds of S/B.
- chain: node k receives from k-1 and relays each chunk onwards as soon as it has arrived, so
  every link carries the model once and the total is about S/B plus one chunk per hop.

``choose`` picks tree for small payloads (latency-bound: few hops) and chain for large ones
(bandwidth-bound), star for one or two workers.
"""

from __future__ import annotations

from collective.errors import UsageError

TOPOLOGIES = ("auto", "star", "tree", "chain")
CHAIN_FROM_BYTES = 16 << 20
# Default chunk size of a chain (an explicit --chunk-bytes wins): the pipeline fills one chunk
# per hop, so 8 workers at 200 Mbit/s took 1.73x S/B with 4 MiB chunks and 1.12x with 512 KiB.
CHAIN_CHUNK_BYTES = 512 << 10


def parents(topology: str, workers: int) -> list[int]:
    if topology == "star":
        return [-1] * workers
    if topology == "chain":
        return [r - 1 for r in range(workers)]  # rank 0 from the chief, r from r-1
    if topology == "tree":
        out = []
        for r in range(workers):
            node = r + 1
            parent_node = node - (1 << (node.bit_length() - 1))
            out.append(parent_node - 1)
        return out
    raise UsageError(f"unknown topology {topology!r}; use one of {', '.join(TOPOLOGIES)}")


def choose(topology: str, workers: int, total_bytes: int) -> str:
    """Resolve ``auto``: star for 1-2 workers, tree below 16 MiB, chain from there."""
    if topology != "auto":
        parents(topology, 1)  # validates the name
        return topology
    if workers <= 2:
        return "star"
    return "chain" if total_bytes >= CHAIN_FROM_BYTES else "tree"
