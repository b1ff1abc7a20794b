"""Who receives from whom."""

import math
from collections import Counter

import pytest

from collective.errors import UsageError
from collective.topology import (
    MODELLED,
    TOPOLOGIES,
    UNMODELLED,
    arrange,
    carrier,
    choose,
    dtree_parents,
    parents,
    predict,
    trees,
)


def test_star_has_every_worker_receive_from_the_chief():
    assert parents("star", 4) == [-1, -1, -1, -1]


def test_chain_has_each_worker_receive_from_the_one_before():
    assert parents("chain", 4) == [-1, 0, 1, 2]


def test_tree_is_binomial_with_the_chief_at_its_root():
    # nodes: 0 chief, k = rank k-1; node k receives from k - 2**floor(log2 k)
    assert parents("tree", 7) == [-1, -1, 0, -1, 0, 1, 2]


@pytest.mark.parametrize("n", [1, 2, 3, 8, 33])
def test_every_topology_reaches_every_worker_from_the_chief_without_cycles(n):
    for topo in ("star", "tree", "chain"):
        ps = parents(topo, n)
        for r in range(n):
            seen, node = set(), r
            while node != -1:
                assert node not in seen and 0 <= node < n
                seen.add(node)
                node = ps[node]


def test_auto_never_picks_a_star_for_two_or_more_network_receivers_of_a_large_payload():
    # issue 11 item 18: two workers on two hosts took 2.09x S/B in a star, 1.06x in a chain
    for receivers in (2, 3, 4, 8, 16):
        # a chain: the double tree, predicted faster from four hosts on, took up to 1.08x its
        # prediction on emulated hosts, and auto takes it only where it wins by 1.08x (from 6 hosts)
        want = "dtree" if receivers >= 8 else "chain"
        assert choose("auto", receivers, 64 << 20) == want, receivers
        assert receivers < 4 or predict("dtree", receivers, 64 << 20) < predict("chain", receivers, 64 << 20)
    assert choose("auto", 2, 1 << 30) == "chain"
    assert choose("chain", 2, 10) == "chain"


def test_auto_keeps_few_hops_for_small_payloads_and_many_hosts():
    # latency-bound: a 64 KiB model goes straight from the chief to a few receivers
    assert choose("auto", 2, 64 << 10) == "star"
    # a chain of 1,024 hops costs more in per-hop latency than a tree's extra copies, and a
    # double tree has a tree's depth with a chain's one copy per link
    assert predict("chain", 1024, 64 << 20) > predict("tree", 1024, 64 << 20)
    assert choose("auto", 1024, 64 << 20) == choose("auto", 64, 64 << 20) == "dtree"
    assert predict("dtree", 1024, 64 << 20) * UNMODELLED["dtree"] < predict("tree", 1024, 64 << 20)
    assert choose("auto", 1, 0) == "star"  # nothing to pipeline: the simplest


def test_the_model_charges_a_star_one_copy_per_receiver_and_a_chain_one_chunk_per_hop():
    mib_per_s = float(1 << 20)
    star = predict("star", 4, 8 << 20, bytes_per_second=mib_per_s, hop_seconds=0, chunk_bytes=1 << 20)
    chain = predict("chain", 4, 8 << 20, bytes_per_second=mib_per_s, hop_seconds=0, chunk_bytes=1 << 20)
    tree = predict("tree", 4, 8 << 20, bytes_per_second=mib_per_s, hop_seconds=0, chunk_bytes=1 << 20)
    dtree = predict("dtree", 4, 8 << 20, bytes_per_second=mib_per_s, hop_seconds=0, chunk_bytes=1 << 20)
    assert star == pytest.approx(4 * 8)  # the last chunk leaves the chief as it lands
    assert chain == pytest.approx(8 + 3 * 1)  # then it crosses three more hops
    # the root has 3 children of 5 nodes; rank 2 takes each chunk from rank 0, its only child
    assert tree == pytest.approx(3 * 8 + 1)
    # trees of depth 3 (e.g. chief -> 0 -> 2 -> 1 in tree A): 2 hops of a chunk at half a link
    assert dtree == pytest.approx(8 + 2 * 2)
    with_hops = predict("chain", 4, 8 << 20, bytes_per_second=mib_per_s, hop_seconds=0.5, chunk_bytes=1 << 20)
    assert with_hops == pytest.approx(chain + 4 * 0.5)


def test_the_model_is_the_simulators_closed_form():
    """topology.predict against collective/bench/sim.py (links with no token bucket): the same
    structure, so the same figure for every layout, small or large."""
    from collective.bench.sim import Net, simulate

    rate = 25e9 / 8
    for topo in MODELLED:
        for n in (1, 2, 3, 5, 8, 33, 1000):
            for size in (100, 1 << 20, 64 << 20):
                want = simulate(topo, n, size, Net(rate, chunk_seconds=0.002))
                assert predict(topo, n, size, bytes_per_second=rate, hop_seconds=0.002) == pytest.approx(want), (topo, n)


def test_with_sharing_each_other_host_has_one_network_receiver_and_its_peers_receive_from_it():
    hosts = ["b", "a", "b", "chief", "a", "c"]
    lay = arrange("auto", hosts, "chief", 64 << 20, share=True)
    # the leaders of b (rank 0), a (rank 1) and c (rank 5) form the chain, in the hosts' order;
    # rank 3 maps the chief's arena; 2 and 4 receive from their host's leader
    assert lay.topology == "chain" and lay.receivers == 3
    assert lay.parents == [-1, 0, 0, -1, 1, 1]


def test_two_workers_on_two_hosts_form_a_chain_and_two_on_one_other_host_share_one_copy():
    assert arrange("auto", ["h1", "h2"], "chief", 64 << 20, share=True).parents == [-1, 0]
    one_host = arrange("auto", ["h1", "h1"], "chief", 64 << 20, share=True)
    assert one_host.receivers == 1 and one_host.parents == [-1, 0]


def test_without_sharing_the_chain_runs_through_the_workers_ordered_by_host_chief_host_first():
    hosts = ["b", "a", "b", "chief", "a"]
    lay = arrange("chain", hosts, "chief", 64 << 20, share=False)
    # order: chief's host (3), b (0, 2), a (1, 4): each host's link is entered and left once
    assert lay.receivers == 5
    assert lay.parents == [3, 2, 0, -1, 1]


def test_auto_on_the_chiefs_host_alone_streams_straight_from_the_chief_and_builds_a_tree_past_the_cap():
    # one machine without shared memory: every stream is a memory copy, a relay hop only adds work
    from collective.topology import SAME_HOST_STAR_MAX

    for n in (1, 2, 4, SAME_HOST_STAR_MAX):
        lay = arrange("auto", ["vm"] * n, "vm", 256 << 20, share=False)
        assert lay.topology == "star" and lay.parents == [-1] * n, n
    lay = arrange("auto", ["vm"] * (SAME_HOST_STAR_MAX + 1), "vm", 256 << 20, share=False)
    assert lay.topology == "tree" and lay.parents == parents("tree", SAME_HOST_STAR_MAX + 1)
    # one worker elsewhere: a network link is shared again, so the model decides (a chain here)
    assert arrange("auto", ["vm", "vm", "other"], "vm", 256 << 20, share=False).topology == "chain"
    # an explicit choice is kept
    assert arrange("chain", ["vm"] * 4, "vm", 256 << 20, share=False).topology == "chain"


def test_on_the_chiefs_host_alone_the_layout_is_the_rank_order_of_before():
    for topo in ("star", "tree", "chain"):
        assert arrange(topo, ["vm"] * 5, "vm", 1 << 20, share=False).parents == parents(topo, 5)
        assert arrange(topo, ["vm"] * 5, "vm", 1 << 20, share=True).parents == [-1] * 5


@pytest.mark.parametrize("share", [False, True])
def test_every_layout_reaches_every_worker_from_the_chief_without_cycles(share):
    import random

    rng = random.Random(5)
    for _ in range(200):
        n = rng.randint(1, 40)
        hosts = [f"h{rng.randint(0, 6)}" for _ in range(n)]
        lay = arrange(rng.choice(["auto", "star", "tree", "chain"]), hosts, "h0", rng.choice([1 << 10, 1 << 28]),
                      share=share)
        for r in range(n):
            seen, node = set(), r
            while node != -1:
                assert node not in seen and 0 <= node < n
                seen.add(node)
                node = lay.parents[node]
        if share:  # exactly one network receiver per host other than the chief's
            net = [r for r in range(n) if lay.parents[r] == -1 or hosts[lay.parents[r]] != hosts[r]]
            net = [r for r in net if hosts[r] != "h0"]
            assert sorted(hosts[r] for r in net) == sorted(set(hosts) - {"h0"})


def test_an_unknown_topology_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown topology 'ring'"):
        choose("ring", 3, 10)


def _plan(parents_of, addresses):
    import numpy as np

    from collective._proto import collective_pb2 as pb
    from collective.plan import build_plan

    workers = [pb.WorkerInfo(rank=r, worker_id=f"w{r}", devices=["cpu:0"], parent=p, relay_address=a)
               for r, (p, a) in enumerate(zip(parents_of, addresses, strict=True))]
    plan = build_plan([], [], workers, arena=np.zeros(0, np.uint8), chunk_bytes=64, chief_incarnation="x", model="m")
    plan.topology = "chain"
    return plan


def test_a_plan_whose_parents_loop_or_lack_a_relay_is_refused():
    from collective.errors import ProtocolError
    from collective.plan import validate_plan

    validate_plan(_plan([-1, 0, 1], ["h:1", "h:2", ""]))  # a proper chain
    with pytest.raises(ProtocolError, match="do not lead to the chief"):
        validate_plan(_plan([1, 0], ["h:1", "h:2"]))
    with pytest.raises(ProtocolError, match="rank 0 relays to rank 1 but has no relay address"):
        validate_plan(_plan([-1, 0], ["", "h:2"]))


def test_chunk_bytes_takes_a_size_with_a_unit_on_the_chief_and_launch_as_bench_does(capsys):
    from collective.chief.__main__ import build_parser as chief_parser
    from collective.cli import build_parser as cli_parser

    assert chief_parser().parse_args(["--chunk-bytes", "256KiB"]).chunk_bytes == 256 << 10
    assert chief_parser().parse_args(["--chunk-bytes", "65536"]).chunk_bytes == 65536
    assert cli_parser().parse_args(["launch", "--chunk-bytes", "1MiB"]).chunk_bytes == 1 << 20
    with pytest.raises(SystemExit) as exit_info:
        cli_parser().parse_args(["launch", "--chunk-bytes", "12x"])
    assert exit_info.value.code == 2
    assert "--chunk-bytes '12x': expected bytes" in capsys.readouterr().err


def _depth(ps: list[int], rank: int) -> int:
    """Hops from the chief to ``rank`` (failing on a cycle or a parent out of range)."""
    hops, node, seen = 1, rank, set()
    while ps[node] != -1:
        assert node not in seen and 0 <= ps[node] < len(ps)
        seen.add(node)
        node, hops = ps[node], hops + 1
    return hops


@pytest.mark.parametrize("n", [*range(1, 70), 127, 128, 129, 1000, 1023, 1024, 1025, 10_000])
def test_a_double_tree_reaches_every_rank_in_both_trees_each_interior_in_at_most_one(n):
    a, b = dtree_parents(n)
    limit = math.ceil(math.log2(n + 1)) + 1
    for ps in (a, b):
        assert len(ps) == n and ps.count(-1) == 1  # one root under the chief
        assert max(_depth(ps, r) for r in range(n)) <= limit
        assert max(Counter(p for p in ps if p >= 0).values(), default=0) <= 2  # binary
    interior_a, interior_b = {p for p in a if p >= 0}, {p for p in b if p >= 0}
    assert not interior_a & interior_b


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 100, 1024])
@pytest.mark.parametrize("chunks", [1, 2, 5, 64])
def test_a_double_tree_sends_each_chunk_down_one_tree_and_each_uplink_carries_the_model_once(n, chunks):
    both = trees("dtree", n)
    sent = Counter()  # chunks each node's uplink carries; node -1 is the chief
    for c in range(chunks):
        ps = both[carrier("dtree", c)]
        for p in ps:
            sent[p] += 1
    assert sent[-1] == chunks  # the chief sends each chunk once, to one root
    # an odd number of chunks gives one tree one chunk more: a node with two children there sends it twice
    assert max(sent.values()) <= chunks + chunks % 2
    assert {carrier("dtree", c) for c in range(chunks)} == ({0, 1} if chunks > 1 else {0})


def test_a_double_tree_is_offered_and_laid_out_by_host_with_a_second_parent_for_each_leader():
    assert "dtree" in TOPOLOGIES and parents("dtree", 4) == trees("dtree", 4)[0]
    hosts = ["a", "a", "b", "c", "d", "e"]
    lay = arrange("dtree", hosts, "chief", 64 << 20, share=True)
    # the leaders of a..e (ranks 0, 2, 3, 4, 5) form both trees; rank 1 maps rank 0's arena
    a, b = trees("dtree", 5)
    net = [0, 2, 3, 4, 5]
    assert lay.topology == "dtree" and lay.receivers == 5 and lay.parents[1] == 0 and lay.parents_b[1] is None
    assert [lay.parents[r] for r in net] == [-1 if p < 0 else net[p] for p in a]
    assert [lay.parents_b[r] for r in net] == [-1 if p < 0 else net[p] for p in b]
    assert arrange("chain", hosts, "chief", 64 << 20, share=True).parents_b is None
