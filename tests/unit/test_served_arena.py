"""A host leader's arena (``ServedArena``): filled while a relay reads it, sealed, then mapped by
its same-host peers; nobody's writes reach anybody else."""

from __future__ import annotations

import mmap
import threading

import numpy as np
import pytest

from collective.transport.shm import ServedArena, attach

SIZE = 64 * 4096


@pytest.fixture
def leader():
    served = ServedArena(SIZE, name=f"collective-test-served-{id(object())}", secret="s3",
                         admit=lambda wid, inc: None if wid == "peer" else "not a peer", wait=10.0)
    yield served
    served.close()


def test_a_peer_waits_for_the_complete_arena_and_maps_it_while_the_relay_keeps_reading(leader):
    reader = leader.reader()  # as the relay holds it through the whole round
    got = {}
    peer = threading.Thread(target=lambda: got.update(view=attach(leader.server.name, "s3", "peer", "i", SIZE, wait=10)))
    peer.start()
    expected = (np.arange(SIZE) % 241).astype(np.uint8)
    leader.writable[:] = expected
    assert np.array_equal(reader, expected)  # the relay sees each write at once
    assert peer.is_alive()  # nothing is handed out before complete()
    own = leader.complete()
    peer.join(10)
    view = got["view"]
    assert view is not None and np.array_equal(view, expected) and np.array_equal(own, expected)
    # Sealed: a writable shared mapping of the segment cannot be made any more.
    with pytest.raises(PermissionError):
        mmap.mmap(leader.shared.fd, SIZE)
    # Training writes stay private: the leader's, the peer's and the relay's views are independent.
    own[0], view[1] = 7, 9
    assert view[0] == expected[0] and own[1] == expected[1] and reader[0] == expected[0]


def test_a_stranger_is_refused_and_a_peer_still_waiting_when_the_leader_stops_is_told_no(leader):
    assert attach(leader.server.name, "s3", "stranger", "i", SIZE, wait=5) is None
    got = {}
    peer = threading.Thread(target=lambda: got.update(view=attach(leader.server.name, "s3", "peer", "i", SIZE, wait=30)))
    peer.start()
    leader.server.close()  # the leader failed: the peer takes the network, now, not in 30 s
    peer.join(10)
    assert not peer.is_alive() and got["view"] is None


def test_a_waiting_peer_gives_up_as_soon_as_the_round_is_cancelled(leader):
    cancelled = threading.Event()
    got = {}
    peer = threading.Thread(target=lambda: got.update(
        view=attach(leader.server.name, "s3", "peer", "i", SIZE, wait=60, cancelled=cancelled.is_set)))
    peer.start()
    cancelled.set()  # the heartbeat heard the round failed: no waiting for the 60 s
    peer.join(10)
    assert not peer.is_alive() and got["view"] is None
