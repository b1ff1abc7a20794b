"""collective.parking: a call that waits for the round holds no thread while it waits."""

from __future__ import annotations

import threading
import time

import pytest

from collective import parking


class Round:
    """A stand-in for the chief's state: one flag behind a parking.Condition."""

    def __init__(self, key: str | None = None) -> None:
        self.cond = parking.Condition(threading.RLock())
        self.released = False
        self.key = key
        self.asked_by: list[bool] = []

    def await_release(self, timeout: float) -> str:
        with self.cond:
            self.asked_by.append(parking.retrying())
            if not parking.wait_for(self.cond, lambda: self.released, timeout, self.key):
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


def _park_many(r: Round, parker: parking.Parker, n: int) -> tuple[list, threading.Event]:
    got, done = [], threading.Event()

    def answered(result, error) -> None:
        got.append(result)
        if len(got) == n:
            done.set()

    for _ in range(n):
        try:
            parking.poll(r.await_release, 30.0)
        except parking.NotYet as waiting:
            parker.park(lambda: r.await_release(30.0), time.monotonic() + 30.0, answered, parking.generation, waiting)
    return got, done


def _notify_without_news(r: Round, times: int) -> None:
    for _ in range(times):  # the round changed, but not what the calls wait for
        with r.cond:
            r.cond.notify_all()
        time.sleep(0.03)  # past the parker's rest, so each notify is a batch of its own


@pytest.mark.parametrize("key", [None, "released"])
def test_a_parked_call_with_a_key_is_tried_again_only_once_its_predicate_holds(key):
    """Issue 31: every notify tried every parked call again (1,024 calls x ~1,000 notifies per
    round at 1,024 workers). With a key, the parker asks the predicate once per notify and
    tries no call until it holds."""
    r, parker = Round(key), parking.Parker("test-parker")
    try:
        got, done = _park_many(r, parker, 50)
        _notify_without_news(r, 10)
        before = parker.tries
        r.release()
        assert done.wait(10.0) and got == ["released"] * 50
        if key is None:  # without one, as before: each notify tried each call again
            assert before >= 50, before
        else:
            assert before == 0 and parker.tries == 50, (before, parker.tries)
            assert 1 <= parker.checks <= 20, parker.checks  # one per notify (11 here) at most, and none idle
    finally:
        parker.close()


def test_a_batch_looks_only_at_what_changed_not_at_every_parked_call():
    """Issue 39: each batch went through every parked call (N x notifies at N workers). Calls
    are filed by key, deadlines in a heap: notifies without news look at no call, a deadline
    that passes looks at its call alone, and a release looks at each of its calls once."""
    r, other, parker = Round("released"), Round("other"), parking.Parker("test-parker")
    try:
        got, done = _park_many(r, parker, 200)
        _park_many(other, parker, 100)  # a second key, never released while the test looks
        early, answered = [], threading.Event()
        parker.park(lambda: r.await_release(0.3), time.monotonic() + 0.3,
                    lambda result, error: (early.append(result), answered.set()), parking.generation,
                    parking.NotYet(r.cond, lambda: r.released, "released"))
        _notify_without_news(r, 10)
        assert answered.wait(5.0) and early == ["not released within 0.3 s"]
        assert parker.looked == 1 and parker.tries == 1, (parker.looked, parker.tries)  # the expired call alone
        assert parker.checks >= 1  # a look at each key per batch, instead
        r.release()
        assert done.wait(10.0) and got == ["released"] * 200
        assert parker.looked == 201 and parker.tries == 201, (parker.looked, parker.tries)
        assert len(parker) == 100
    finally:
        parker.close()


def test_settle_returns_once_the_call_being_answered_is_done_with_what_it_read():
    """A finished round's service is held by the parked call the parker is answering at that
    moment; ``release_freed_memory`` settles the parker before it collects (a sync_module under
    load kept its chief's service after it returned, 1 run in 6)."""
    r, parker, answering, finished = Round(), parking.Parker("test-parker"), threading.Event(), []

    def slow_answer():
        answer = r.await_release(30.0)
        answering.set()
        time.sleep(0.5)  # still holding what it read
        finished.append(answer)
        return answer

    try:
        with pytest.raises(parking.NotYet):
            parking.poll(r.await_release, 30.0)
        parker.park(slow_answer, time.monotonic() + 30.0, lambda result, error: None, parking.generation)
        r.release()
        assert answering.wait(5.0)
        assert parker.settle(10.0) and finished == ["released"] and len(parker) == 0
    finally:
        parker.close()
    assert parker.settle(1.0)  # a closed parker has nothing left to settle


def test_the_prepared_barrier_counts_its_members_and_stays_open_once_open():
    """Issue 39: each of N parked AwaitPrepared calls read every member (N^2 as the barrier
    opened). RoundState counts the members marked prepared and reads them only when the count
    says they may all be; a member replaced by a rejoin still counts, so the count never falls
    short, and the read says no until the new one is prepared too."""
    from collective.chief.members import Member
    from collective.chief.state import RoundState

    def member(worker_id: str, rank: int) -> Member:
        return Member(rank=rank, worker_id=worker_id, incarnation="i", host="h", devices=["cpu:0"], peer="p", pid=1)

    state = RoundState(None, time.monotonic())
    a, b = member("a", 0), member("b", 1)
    state.members.update(a=a, b=b)
    state.mark_prepared(a)
    state.mark_prepared(a)  # twice: counted once
    assert state.prepared_count == 1 and not state.all_prepared()
    state.mark_prepared(b)
    state.members["b"] = member("b", 1)  # a rejoin replaced it before the barrier was read
    assert state.prepared_count == 2 and not state.all_prepared()
    state.mark_prepared(state.members["b"])
    assert state.all_prepared()
    state.members["c"] = member("c", 2)  # once open, it stays open: the first bytes are out
    assert state.all_prepared()
