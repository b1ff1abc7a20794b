"""``subscriber.check_delta``: a delta document is checked against the step held and the new
step's plan before anything is written; each refusal is one ProtocolError line naming the
holder, and a hostile count costs no memory."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest

from collective import delta as D
from collective.errors import ProtocolError
from collective.snapshot import holder, versions
from collective.snapshot.subscriber import check_delta

HOLDER = "holder evil at 10.0.0.9:7000"


def _plans():
    a = {"w": np.arange(100_000, dtype=np.float32), "b": np.ones(10, np.float32)}
    b = {"w": a["w"].copy(), "b": a["b"].copy()}
    b["w"][::100] += 1
    old, _, _ = holder.build(a, 0, copy=True, chunk_bytes=1 << 16)
    new, arena, keep = holder.build(b, 1, copy=True, chunk_bytes=1 << 16)
    tree_bytes = np.array(keep[3].arena[new.variables[-1].offset:][: new.variables[-1].nbytes])
    doc = versions.delta_state(0, old.manifest_digest, 1, new.manifest_digest, ["w"],
                               [D.make_delta(a["w"], b["w"]).to_bytes()], tree_bytes)
    return old, new, doc


def test_an_honest_delta_document_parses():
    old, new, doc = _plans()
    parsed, tree_bytes = check_delta(doc, 0, old, new, HOLDER)
    assert [name for name, _ in parsed] == ["w"] and parsed[0][1].count == 1000


@pytest.mark.parametrize("forge, words", [
    (lambda d: {**d, "from": 3}, "is from step 3"),
    (lambda d: {**d, "manifest": "f" * 32}, "leads to step 1 (manifest 'fff"),
    (lambda d: {**d, "names": ["w", "w"], "deltas": d["deltas"] * 2}, "names a tensor twice"),
    (lambda d: {**d, "names": ["nope"]}, "names a tensor 'nope' the state does not have"),
    (lambda d: {**d, "names": ["w", "b"]}, "one for one"),
    (lambda d: {**d, "tree": d["tree"][:-1]}, "skeleton of another size"),
    (lambda d: {**d, "extra": 1}, "is not a delta document"),
    (lambda d: {**d, "deltas": [d["deltas"][0][:-1]]}, "does not parse"),
])
def test_a_forged_delta_document_is_refused_in_one_line_naming_the_holder(forge, words):
    old, new, doc = _plans()
    with pytest.raises(ProtocolError) as info:
        check_delta(forge(doc), 0, old, new, HOLDER)
    text = str(info.value)
    assert words in text and HOLDER in text and "nothing written" in text and "\n" not in text


def test_a_billion_positions_claimed_for_a_small_tensor_is_refused_from_its_header():
    old, new, doc = _plans()
    blob = bytearray(doc["deltas"][0].tobytes())
    struct.pack_into("<Q", blob, 16, 1 << 30)  # 2^30 changed elements of a 100,000-element tensor
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="does not parse"):
            check_delta({**doc, "deltas": [np.frombuffer(bytes(blob), np.uint8)]}, 0, old, new, HOLDER)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # refused before allocating anything of its size
