"""Publication.update / collective.subscribe over real gRPC on 127.0.0.1: each step's delta
applied in place and verified; a subscriber behind, a step of other shapes, steps applied late;
hostile holders (a delta for another base, a count past the tensor, values that do not
reproduce the step); the publisher gone and its successor followed."""

from __future__ import annotations

import logging
import struct

import ml_dtypes
import numpy as np
import pytest

import collective
from collective import delta as D
from collective.errors import UsageError
from collective.snapshot import versions
from tests.clusters import TOKEN

pytestmark = pytest.mark.integration

WAIT = 60.0  # seconds a test waits for a step that must come (a loaded machine)


def _state(seed: int = 0, n: int = 400_000) -> dict:
    rng = np.random.default_rng(seed)
    return {"layer": {"w": rng.standard_normal(n).astype(ml_dtypes.bfloat16),
                      "b": rng.standard_normal(1000).astype(np.float32)},
            "frozen": np.arange(5000, dtype=np.int32), "lr": 1e-5, "name": "run"}


def _step(state: dict, rng, fraction: float = 0.01) -> None:
    """Change ``fraction`` of w's elements (bit for bit: +1 in bf16) and b a little, in place."""
    w = state["layer"]["w"]
    idx = rng.choice(w.size, max(1, int(w.size * fraction)), replace=False)
    w[idx] = (w[idx].astype(np.float32) + 1).astype(ml_dtypes.bfloat16)
    state["layer"]["b"][:3] += 1


def _publish(state, step=0, **kw):
    return collective.publish(state, step=step, copy=True, bind="127.0.0.1:0", token=TOKEN, name="trainer", **kw)


def _same_bytes(sub, state) -> None:
    assert sub.state["layer"]["w"].tobytes() == state["layer"]["w"].tobytes()
    assert sub.state["layer"]["b"].tobytes() == state["layer"]["b"].tobytes()
    assert sub.state["frozen"].tobytes() == state["frozen"].tobytes()


def test_each_step_arrives_as_its_delta_applied_in_place_and_verified():
    state, rng = _state(), np.random.default_rng(1)
    w = np.zeros(400_000, ml_dtypes.bfloat16)
    with _publish(state) as pub:
        with collective.subscribe(pub.address, token=TOKEN, into={"layer/w": w}, shm=False) as sub:
            assert (sub.step, sub.manifest_digest) == (0, pub.manifest_digest)
            assert sub.state["layer"]["w"] is w  # the caller's array, not a copy
            for step in range(1, 4):
                served = pub.stats()["bytes_served"]
                _step(state, rng)
                state["lr"] = 1e-5 / (step + 1)
                pub.update(state, step, wait=True)
                assert sub.apply(timeout=WAIT) == step
                assert (sub.step, sub.manifest_digest) == (step, pub.manifest_digest)
                _same_bytes(sub, state)
                assert sub.state["lr"] == state["lr"] and sub.state["layer"]["w"] is w
                assert sub.stats["kind"] == "delta"
                # the unchanged int tensor costs nothing; w goes as 1% of its elements
                assert pub.last_update["changed_tensors"] == 2
                sent = pub.stats()["bytes_served"] - served
                total = pub.total_bytes
                assert sent == sub.stats["bytes"] and sent < 0.03 * total, (sent, total)


def test_steps_not_yet_applied_are_applied_together_in_order():
    state, rng = _state(), np.random.default_rng(2)
    with _publish(state) as pub, collective.subscribe(pub.address, token=TOKEN) as sub:
        for step in (1, 2, 3):
            _step(state, rng)
            pub.update(state, step, wait=True)
            collective_wait(sub, step)
        assert sub.apply(timeout=WAIT) == 3 and sub.manifest_digest == pub.manifest_digest
        _same_bytes(sub, state)


def collective_wait(sub, step: int) -> None:
    """Until the subscription has received ``step`` (not applied)."""
    import time

    deadline = time.monotonic() + WAIT
    while (sub.poll(timeout=0.5) or -1) < step:
        assert time.monotonic() < deadline, f"step {step} not received"


def test_a_subscriber_behind_or_following_another_publication_gets_the_step_whole():
    state, rng = _state(), np.random.default_rng(3)
    with _publish(state) as pub, collective.subscribe(pub.address, token=TOKEN) as sub:
        other_state = _state(seed=9)
        with _publish(other_state, step=6) as other:
            _step(other_state, rng)
            other.update(other_state, 7, wait=True)  # it serves step 7 and a delta from 6, not from 0
            sub.follow(other.address)
            assert sub.apply(timeout=WAIT) == 7
            assert sub.stats["kind"] == "full" and sub.manifest_digest == other.manifest_digest
            _same_bytes(sub, other_state)


def test_tensors_of_another_shape_come_whole_and_into_arrays_refuse_them_in_one_line():
    state = _state()
    with _publish(state) as pub:
        with collective.subscribe(pub.address, token=TOKEN) as own:
            w = np.zeros(400_000, ml_dtypes.bfloat16)
            with collective.subscribe(pub.address, token=TOKEN, into={"layer/w": w}) as caller:
                bigger = _state(n=500_000)
                pub.update(bigger, 1, wait=True)
                assert own.apply(timeout=WAIT) == 1 and own.stats["kind"] == "full"
                _same_bytes(own, bigger)
                with pytest.raises(UsageError, match="other names, shapes or dtypes than the into arrays"):
                    caller.apply(timeout=WAIT)
                assert caller.step == 0  # it keeps the step it verified


@pytest.fixture
def lying(monkeypatch):
    """lie(fn): the publisher (in this process) serves fn(doc) as each step's delta document."""
    real = versions.delta_state

    def lie(fn):
        monkeypatch.setattr(versions, "delta_state", lambda *a: fn(real(*a)))

    return lie


def _hostile_case(lie, forge, caplog) -> collective.Subscription:
    """A publisher whose deltas are ``forge``d: the subscriber refuses them, names the holder,
    and gets the step whole (bit for bit)."""
    state, rng = _state(), np.random.default_rng(4)
    with _publish(state) as pub, collective.subscribe(pub.address, token=TOKEN, shm=False) as sub:
        lie(forge)
        _step(state, rng)
        with caplog.at_level(logging.WARNING, logger="collective.snapshot.subscriber"):
            pub.update(state, 1, wait=True)
            assert sub.apply(timeout=WAIT) == 1
        assert sub.stats["kind"] == "full" and sub.manifest_digest == pub.manifest_digest
        _same_bytes(sub, state)
        assert sub.refusals and pub.address in sub.refusals[0]
        return sub


def test_a_delta_for_another_base_is_refused_named_and_the_step_fetched_whole(lying, caplog):
    sub = _hostile_case(lying, lambda doc: {**doc, "base": "0" * 32}, caplog)
    assert "is from step 0 (manifest '000" in sub.refusals[0]


def _count_past_size(doc):
    blob = bytearray(doc["deltas"][0].tobytes())
    if blob[4] == D.ELEMENTS:
        struct.pack_into("<Q", blob, 16, 1 << 40)  # 2^40 changed elements in a 400,000-element tensor
    return {**doc, "deltas": [np.frombuffer(bytes(blob), np.uint8), *doc["deltas"][1:]]}


def test_a_delta_claiming_more_elements_than_the_tensor_has_is_refused_before_anything_is_written(lying, caplog):
    sub = _hostile_case(lying, _count_past_size, caplog)
    assert "does not parse" in sub.refusals[0]


def _wrong_value(doc):
    blob = bytearray(doc["deltas"][0].tobytes())
    blob[40] ^= 0x55  # the first new value (after the 40-byte header): parses, applies, does not verify
    return {**doc, "deltas": [np.frombuffer(bytes(blob), np.uint8), *doc["deltas"][1:]]}


def test_a_delta_that_does_not_reproduce_the_step_is_caught_after_applying_and_repaired(lying, caplog):
    sub = _hostile_case(lying, _wrong_value, caplog)
    assert "did not reproduce" in sub.refusals[0]


def test_a_local_corruption_is_found_by_verify_and_repaired():
    state = _state()
    with _publish(state) as pub, collective.subscribe(pub.address, token=TOKEN) as sub:
        sub.state["frozen"][17] = -1
        sub.verify()
        _same_bytes(sub, state)


def test_the_subscriber_keeps_its_step_when_the_publisher_dies_and_follows_its_successor(caplog):
    state, rng = _state(), np.random.default_rng(5)
    pub = _publish(state)
    address = pub.address
    with collective.subscribe(address, token=TOKEN) as sub:
        with caplog.at_level(logging.WARNING, logger="collective.snapshot.subscriber"):
            pub.close()
            assert sub.apply(timeout=3) is None and sub.step == 0
            import time

            deadline = time.monotonic() + WAIT
            while "holding step 0" not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.1)
        _step(state, rng)
        with collective.publish(state, step=5, copy=True, bind=address, token=TOKEN) as successor:
            assert sub.apply(timeout=WAIT) == 5 and sub.manifest_digest == successor.manifest_digest
            _same_bytes(sub, state)


def test_update_refuses_a_publication_served_in_place_and_steps_that_do_not_increase():
    state = _state()
    with collective.publish(state, step=0, bind="127.0.0.1:0", token=TOKEN) as in_place:
        with pytest.raises(UsageError, match="copy=True"):
            in_place.update(state, 1)
    with _publish(state, step=3) as pub:
        with pytest.raises(UsageError, match="steps must increase"):
            pub.update(state, 3)


def _wait_all(subs, step: int) -> None:
    import time

    deadline = time.monotonic() + WAIT
    while any(s.step < step for s in subs):
        assert time.monotonic() < deadline, [s.step for s in subs]
        time.sleep(0.01)


def test_a_tree_of_serving_subscribers_takes_each_delta_once_from_the_publishers_link():
    """Seven subscribers in a tree (each serves what it applied; the publisher is every one's
    spare): per step the publisher serves one delta, however many follow; a subscriber whose
    parent is gone takes the steps from the publisher."""
    state, rng = _state(n=1_000_000), np.random.default_rng(6)
    kw = dict(token=TOKEN, shm=False, auto=True, stripe=False, serve=True, bind="127.0.0.1:0")
    with _publish(state) as pub:
        subs = [collective.subscribe(pub.address, name="s0", **kw)]
        for i in range(1, 7):
            parent = subs[(i - 1) // 2]
            subs.append(collective.subscribe([parent.address, pub.address], name=f"s{i}", **kw))
        try:
            assert pub.stats()["bytes_served"] == pub.total_bytes  # s0's first fetch; the rest from peers
            for step in (1, 2, 3):
                served = pub.stats()["bytes_served"]
                _step(state, rng)
                pub.update(state, step, wait=True)
                _wait_all(subs, step)
                assert pub.stats()["bytes_served"] - served == pub.last_update["delta_bytes"]
                for s in subs:
                    assert s.manifest_digest == pub.manifest_digest and s.stats["kind"] == "delta"
                    _same_bytes(s, state)
            subs[1].close()  # s3 and s4's parent
            _step(state, rng)
            pub.update(state, 4, wait=True)
            _wait_all([s for i, s in enumerate(subs) if i != 1], 4)
            for s in subs[3:5]:
                assert s.manifest_digest == pub.manifest_digest
                _same_bytes(s, state)
        finally:
            for s in subs:
                s.close()
