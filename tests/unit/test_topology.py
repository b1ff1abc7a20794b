"""Who receives from whom."""

import pytest

from collective.errors import UsageError
from collective.topology import choose, parents


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


def test_auto_picks_star_for_two_workers_tree_for_small_and_chain_for_large_payloads():
    assert choose("auto", 2, 1 << 30) == "star"
    assert choose("auto", 8, 1 << 20) == "tree"
    assert choose("auto", 8, 64 << 20) == "chain"
    assert choose("chain", 2, 10) == "chain"


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
