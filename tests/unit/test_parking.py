"""collective.parking: a call that waits for the round holds no thread while it waits."""

from __future__ import annotations

import threading
import time

import pytest

from collective import parking


class Round:
    """A stand-in for the chief's state: one flag behind a parking.Condition."""

    def __init__(self) -> None:
        self.cond = parking.Condition(threading.RLock())
        self.released = False
        self.asked_by: list[bool] = []

    def await_release(self, timeout: float) -> str:
        with self.cond:
            self.asked_by.append(parking.retrying())
            if not parking.wait_for(self.cond, lambda: self.released, timeout):
                return f"not released within {timeout:g} s"
            return "released"

    def release(self) -> None:
        with self.cond:
            self.released = True
            self.cond.notify_all()


def test_poll_mode_raises_not_yet_and_a_plain_call_still_blocks_until_notified():
    r = Round()
    with pytest.raises(parking.NotYet):
        parking.poll(r.await_release, 5.0)
    assert parking.poll(r.await_release, 0.0) == "not released within 0 s"  # a wait of 0 answers at once
    threading.Timer(0.2, r.release).start()
    assert r.await_release(5.0) == "released"


def test_a_parked_call_is_answered_by_the_parking_thread_when_the_condition_is_notified():
    r, parker, got = Round(), parking.Parker("test-parker"), []
    try:
        with pytest.raises(parking.NotYet):
            parking.poll(r.await_release, 30.0)
        done = threading.Event()
        parker.park(lambda: r.await_release(30.0), time.monotonic() + 30.0,
                    lambda result, error: (got.append((result, error)), done.set()), parking.generation)
        time.sleep(0.3)
        assert not done.is_set() and len(parker) == 1
        r.release()
        assert done.wait(5.0) and got == [("released", None)]
        assert r.asked_by[0] is False and all(r.asked_by[1:])  # retries are the parker's, no news from the caller
    finally:
        parker.close()


def test_a_parked_call_is_answered_at_its_deadline_in_the_logics_own_words():
    r, parker, got = Round(), parking.Parker("test-parker"), []
    try:
        done = threading.Event()
        parker.park(lambda: r.await_release(0.5), time.monotonic() + 0.5,
                    lambda result, error: (got.append(result), done.set()), parking.generation)
        assert done.wait(5.0) and got == ["not released within 0.5 s"]
        assert len(parker) == 0
    finally:
        parker.close()
