"""collective/bench/sim.py: the simulator of the project's layouts, and its fit (collective/bench/simreport.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from collective._proto import collective_pb2 as pb
from collective.bench import simreport
from collective.bench.sim import Net, chunk_sizes, simulate
from collective.stream import frame_messages
from collective.topology import bucket_bytes, predict

MIB = 1 << 20
ONE_MIB_PER_S = Net(float(MIB))


def test_chunks_are_cut_as_the_plans_stream_cuts_them():
    assert chunk_sizes(10 * MIB + 5, 4 * MIB) == [4 * MIB, 4 * MIB, 2 * MIB + 5]
    plan = pb.Plan(total_bytes=3 * MIB + 1, chunk_bytes=MIB)
    assert chunk_sizes(3 * MIB + 1, MIB) == [e - s for _m, s, e in frame_messages(plan) if e > s]


def test_a_star_puts_one_copy_per_receiver_on_the_chiefs_link_and_a_chain_one_chunk_per_hop():
    assert simulate("star", 4, 8 * MIB, ONE_MIB_PER_S, chunk_bytes=MIB) == pytest.approx(32)
    assert simulate("chain", 4, 8 * MIB, ONE_MIB_PER_S, chunk_bytes=MIB) == pytest.approx(8 + 3)
    # every hop adds its latency and the relay's per-chunk cost, once
    slow = Net(float(MIB), hop_seconds=0.25, chunk_seconds=0.25, fixed_seconds=1)
    assert simulate("chain", 4, 8 * MIB, slow, chunk_bytes=MIB) == pytest.approx(8 + 3 + 4 * 0.5 + 1)
    # a link that carries 95 % payload takes 1 / 0.95 as long
    assert simulate("star", 1, 8 * MIB, Net(float(MIB), efficiency=0.95), chunk_bytes=MIB) == pytest.approx(8 / 0.95)


@pytest.mark.parametrize("hosts", [1, 2, 3, 64, 1024])
def test_a_double_tree_moves_the_model_at_link_rate_whatever_the_hosts(hosts):
    # 10 GiB at 25 Gbit/s: every link carries the model once, so the fill of log2 hops is all it adds
    rate = 25e9 / 8
    size = 10 << 30
    t = simulate("dtree", hosts, size, Net(rate))
    assert 0.9999 * size / rate <= t <= 1.01 * size / rate


def test_a_double_trees_receiver_takes_its_two_parents_streams_at_half_a_link_each():
    # two receivers, 2 chunks: each tree carries one chunk, root -> other receiver at half a link
    assert simulate("dtree", 2, 2 * MIB, ONE_MIB_PER_S, chunk_bytes=MIB) == pytest.approx(2 + 2)
    # one chunk: only tree A carries anything, so its one stream has the whole link
    assert simulate("dtree", 1, MIB, ONE_MIB_PER_S, chunk_bytes=MIB) == pytest.approx(1)


def test_a_token_bucket_lets_each_relays_link_catch_up_while_it_waits():
    """tc tbf's bucket refills while a relay's link waits for the next chunk; a chain's hop then
    takes less than a chunk at the shaped rate, by at most the bucket."""
    plain = Net(float(MIB), chunk_seconds=0.5)
    bucket = Net(float(MIB), chunk_seconds=0.5, burst_bytes=MIB // 4)
    t_plain = simulate("chain", 8, 16 * MIB, plain, chunk_bytes=MIB)
    t_bucket = simulate("chain", 8, 16 * MIB, bucket, chunk_bytes=MIB)
    assert t_plain - 8 * 0.25 - 1e-9 <= t_bucket < t_plain - 7 * 0.25 + 1e-9


def test_a_double_trees_receivers_get_the_bucket_less_the_other_senders_chunk_in_flight():
    """A double tree's receiver takes one stream from each of two senders, so its downlink's
    bucket always holds the other sender's chunk in flight. Emulated (256 KiB bucket, 512 KiB
    chunks), its runs took about 11 ms a level longer than a simulation that gave each stream the
    whole bucket; with a 1 MiB bucket they took less than one that gave none."""
    plain = Net(float(MIB), chunk_seconds=0.5)
    for hosts in (2, 4, 16):
        # a bucket of one chunk or less is all taken: the same as none
        assert simulate("dtree", hosts, 16 * MIB, replace(plain, burst_bytes=MIB), chunk_bytes=MIB) == pytest.approx(
            simulate("dtree", hosts, 16 * MIB, plain, chunk_bytes=MIB))
        # a larger one leaves the rest
        assert simulate("dtree", hosts, 16 * MIB, replace(plain, burst_bytes=2 * MIB), chunk_bytes=MIB) < (
            simulate("dtree", hosts, 16 * MIB, plain, chunk_bytes=MIB))
    assert bucket_bytes(MIB // 4, MIB // 2, 1) == MIB // 4 and bucket_bytes(MIB // 4, MIB // 2, 2) == 0
    assert bucket_bytes(MIB, MIB // 2, 2) == MIB // 2
    # and topology.predict charges the double tree's hops the same way
    kw = dict(bytes_per_second=float(MIB), hop_seconds=0.5, chunk_bytes=MIB)
    assert predict("dtree", 16, 16 * MIB, burst_bytes=MIB, **kw) == predict("dtree", 16, 16 * MIB, **kw)
    assert predict("chain", 4, 16 * MIB, burst_bytes=MIB // 4, **kw) == pytest.approx(
        predict("chain", 4, 16 * MIB, **kw) - 4 * 0.25)


def test_the_fit_recovers_the_inputs_that_made_the_runs():
    made = Net(1.0, efficiency=0.955, chunk_seconds=0.004, fixed_seconds=0.05, burst_bytes=simreport.EMULATED_BURST)
    rate = 25e6
    runs = []
    for topo in ("star", "tree", "chain"):
        for hosts in (1, 2, 4, 8, 16):
            for size in (16 * MIB, 64 * MIB):
                t = simulate(topo, hosts, size, Net(rate, efficiency=made.efficiency, chunk_seconds=made.chunk_seconds,
                                                    fixed_seconds=made.fixed_seconds, burst_bytes=made.burst_bytes))
                runs.append(simreport.Run(topo, hosts, size, rate, t))
    got = simreport.fit(runs)
    assert got.efficiency == pytest.approx(made.efficiency, abs=0.002)
    assert got.chunk_seconds == pytest.approx(made.chunk_seconds, abs=0.0005)
    assert got.fixed_seconds == pytest.approx(made.fixed_seconds, abs=0.02)
    rows = simreport.fit_rows(runs, got)
    assert max(abs(r["sim"] / r["measured"] - 1) for r in rows) < 0.01
    # predict, given the bucket's head start off each hop, tells the same story
    assert max(abs(r["predict"] / r["measured"] - 1) for r in rows) < 0.05


def test_the_recorded_emulated_runs_load_and_fit_within_ten_percent():
    runs = simreport.load_runs()
    assert {r.topology for r in runs} == {"star", "tree", "chain", "dtree"} and len(runs) >= 20
    net = simreport.fit(runs)
    rows = simreport.fit_rows(runs, net)
    assert max(abs(r["sim"] / r["measured"] - 1) for r in rows) < 0.10
    assert max(abs(r["predict"] / r["measured"] - 1) for r in rows) < 0.10
