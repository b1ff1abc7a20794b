"""collective.snapshot's state <-> tensors + JSON skeleton, and the stripes of a stream
(``Receiver(span=ChunkRange(start, stop), base=)``) that a fetch from several holders uses."""

from __future__ import annotations

import itertools
import json
import math
import pickle

import numpy as np
import pytest

from collective._proto import collective_pb2 as pb
from collective.errors import IntegrityError, ProtocolError, UsageError
from collective.snapshot import holder, tree
from collective.stream import Chunker, ChunkRange, Receiver


def _roundtrip(state, step: int = 5):
    skeleton, arrays = tree.flatten(state)
    data = tree.encode(skeleton, step)
    return tree.unflatten(tree.decode(data, step, "holder at X"), {**arrays, tree.TREE: data}, "holder at X")


def test_nested_state_round_trips_with_key_types_tuples_and_odd_floats():
    state = {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "opt": {"state": {0: {"exp_avg": np.ones(3), "step": np.float32(4)}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0], "name": None, "amsgrad": False}]},
        "odd": [float("nan"), float("inf"), -float("inf"), "ünïcode", 10**30],
    }
    got = _roundtrip(state)
    assert list(got) == ["w", "opt", "odd"]
    assert got["w"] is state["w"]  # the leaves are the arrays given (views, at fetch)
    assert list(got["opt"]["state"]) == [0]  # an int key stays an int
    assert got["opt"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert got["opt"]["state"][0]["step"].shape == () and got["opt"]["state"][0]["step"].dtype == np.float32
    assert math.isnan(got["odd"][0]) and got["odd"][1:] == [math.inf, -math.inf, "ünïcode", 10**30]


def test_names_are_key_paths():
    _, arrays = tree.flatten({"layer.0.weight": np.zeros(1), "optimizer": {"state": {3: {"m": np.zeros(1)}}}})
    assert list(arrays) == ["layer.0.weight", "optimizer/state/3/m"]


@pytest.mark.parametrize("leaf, kind", [(object(), "object"), ({1, 2}, "set"), (b"raw", "bytes"),
                                         (np.array(["s"]), "dtype <U1"), (np.array([object()]), "dtype object")])
def test_a_leaf_that_is_neither_tensor_nor_json_is_refused_naming_its_path(leaf, kind):
    with pytest.raises(UsageError) as err:
        tree.flatten({"a": {"b": [1, leaf]}})
    assert "state['a']['b'][1]" in str(err.value) and kind in str(err.value)


def test_colliding_reserved_and_odd_keys_are_refused():
    with pytest.raises(UsageError, match="same name"):
        tree.flatten({"a/b": np.zeros(1), "a": {"b": np.zeros(1)}})
    with pytest.raises(UsageError, match="reserved"):
        tree.flatten({tree.TREE: np.zeros(1)})
    with pytest.raises(UsageError, match="keys must be str or int"):
        tree.flatten({(1, 2): 3})
    with pytest.raises(UsageError, match="a mapping"):
        tree.flatten([np.zeros(1)])


def test_a_torch_tensor_leaf_keeps_its_bits_bf16_too():
    torch = pytest.importorskip("torch")
    t = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    f = torch.arange(4.0)
    _, arrays = tree.flatten({"t": t, "f": f})
    assert arrays["t"].dtype.name == "bfloat16"
    assert arrays["t"].view(np.int16).tolist() == t.view(torch.int16).tolist()
    assert np.shares_memory(arrays["f"], f.numpy())  # served in place: no copy of a CPU tensor
    with pytest.raises(UsageError, match="on meta"):
        tree.flatten({"x": torch.zeros(2, device="meta")})


def _decode(obj, step: int = 5):
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    return tree.decode(data, step, "holder at X")


@pytest.mark.parametrize("skeleton, words", [
    ({"z": 1}, "kind 'z'"),
    ({"a": "nope"}, "not a variable"),
    ({"d": [["k", {"a": "x"}], ["j", {"a": "x"}]]}, "used twice"),
    ({"d": [[True, {"v": 1}]]}, "dict entry"),
    ({"d": [["k", {"v": {"__reduce__": 1}}]]}, "kind 'v'"),
    ({"l": []}, "top level"),
    ({"d": []}, "in no leaf"),
])
def test_a_hostile_skeleton_is_refused_naming_the_holder(skeleton, words):
    with pytest.raises(ProtocolError) as err:
        tree.unflatten(_decode({"format": 1, "step": 5, "tree": skeleton}), {"x": np.zeros(1)}, "holder at X")
    assert str(err.value).startswith("holder at X sent a structure") and words in str(err.value)


def test_too_deep_a_skeleton_is_refused():
    node = {"v": 1}
    for _ in range(tree.MAX_TREE_DEPTH + 5):
        node = {"l": [node]}
    with pytest.raises(ProtocolError, match="deeper than"):
        tree.unflatten(_decode({"format": 1, "step": 5, "tree": {"d": [["k", node]]}}), {}, "holder at X")


def test_pickle_non_json_wrong_step_and_constants_are_refused(tmp_path):
    canary = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(canary), "w"))

    for data in (pickle.dumps(Evil()), b"\xff\xfe", b"[" * 100_000, b'{"format": 1, "step": NaN, "tree": {}}'):
        with pytest.raises(ProtocolError, match="holder at X sent a structure that is not JSON"):
            tree.decode(np.frombuffer(data, np.uint8), 5, "holder at X")
    assert not canary.exists()
    with pytest.raises(ProtocolError, match="of step 6 in its plan of step 5"):
        _decode({"format": 1, "step": 6, "tree": {"d": []}})
    with pytest.raises(ProtocolError, match="format 1"):
        _decode({"format": 2, "step": 5, "tree": {"d": []}})


def _plan(arrays: dict, chunk_bytes: int, copy: bool):
    return holder.build(arrays, 1, copy=copy, chunk_bytes=chunk_bytes)


@pytest.mark.parametrize("copy", [False, True])
def test_stripes_of_a_stream_rebuild_the_arena_bit_for_bit(copy):
    rng = np.random.default_rng(3)
    arrays = {f"v{i}": rng.random(n) for i, n in enumerate((1, 700, 3, 2000, 0, 5))}
    plan, arena, _ = _plan(arrays, 1024, copy)
    chunker = Chunker(plan, arena)
    whole = np.zeros(plan.total_bytes, np.uint8)
    size = plan.chunk_bytes
    bounds = list(range(0, plan.total_bytes, 3 * size)) + [plan.total_bytes]
    for a, b in itertools.pairwise(bounds):
        own = np.zeros(b - a, np.uint8)  # a stripe's own buffer (fetch into=)
        stripe = ChunkRange.stripe(a, b, plan)  # stop 0 for the last: to the arena's end
        receivers = [Receiver(plan, whole, span=stripe), Receiver(plan, own, span=stripe, base=a)]
        assert [r.range for r in receivers] == [stripe, stripe]  # what each asks a sender for
        for msg, data in chunker.frames(stripe):
            for r in receivers:
                r.view(msg.offset, len(data))[...] = np.frombuffer(data, np.uint8)
                r.accept(msg, placed=True)
        for r in receivers:
            r.finish()
        assert np.array_equal(own, whole[a:b])
    for name, a in arrays.items():
        v = next(v for v in plan.variables if v.name == name)
        assert whole[v.offset : v.offset + v.nbytes].tobytes() == a.tobytes()


def test_a_copy_and_the_arrays_in_place_make_one_plan():
    rng = np.random.default_rng(5)
    arrays = {"a": rng.random(3), "b": rng.integers(0, 9, 7).astype(np.int8), "c": rng.random((5, 5))}
    copied, _, _ = _plan(arrays, 64, True)
    in_place, _, _ = _plan(arrays, 64, False)
    assert list(copied.chunk_digests) == list(in_place.chunk_digests)  # the padding reads as zeros both ways
    assert copied.manifest_digest == in_place.manifest_digest


def test_a_stripe_that_stops_short_or_runs_past_its_end_is_refused():
    plan, arena, _ = _plan({"x": np.arange(1000.0)}, 1024, True)
    whole = np.zeros(plan.total_bytes, np.uint8)
    r = Receiver(plan, whole, span=ChunkRange(0, 2048))
    frames = list(Chunker(plan, arena).frames())  # the whole stream, not the stripe
    for msg, data in frames[:2]:
        r.view(msg.offset, len(data))[...] = np.frombuffer(data, np.uint8)
        r.accept(msg, placed=True)
    with pytest.raises(ProtocolError):
        r.view(frames[2][0].offset, len(frames[2][1]))
    with pytest.raises(IntegrityError, match="stream ended without its end message"):
        r.finish()
    for span in ((100, 2048), (0, 100), (2048, 1024), (-1024, 2048), (0, plan.total_bytes + 1024)):
        with pytest.raises(ProtocolError, match="a receiver's span of bytes .*: not a range of chunks"):
            Receiver(plan, whole, span=ChunkRange(*span))
    with pytest.raises(ValueError, match="not a stride of them"):  # a part's stride and phase, not the span's
        Receiver(plan, whole, span=ChunkRange(stride=2, phase=1))
    end = pb.Chunk(offset=2048, end=pb.StreamEnd(total_bytes=plan.total_bytes))
    with pytest.raises(IntegrityError, match="stream end claims"):
        r.accept(end, placed=True)


@pytest.mark.parametrize("seed", range(20))
def test_stripes_cover_the_arena_and_a_large_tensors_own_chunks_land_in_place(seed):
    # fetch(into=): the stripes partition the arena at chunk boundaries, none longer than a
    # stripe, and a tensor with an eighth of a stripe of its own chunks is cut out, so those
    # stripes are received into its array (``_Into.target``), never one that holds other bytes.
    from collective.snapshot import fetcher
    from collective.snapshot.stripes import stripes as cut
    from tests.unit.test_plan import make_plan

    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 40_000, rng.integers(1, 12))
    plan, _, _, _ = make_plan({f"v{i}": np.ones(int(n), np.float32) for i, n in enumerate(sizes)}, chunk_bytes=4096)
    per = int(rng.integers(1, 12))
    stripes = cut(plan, per, inside=True)
    edges = [a for a, _ in stripes] + [stripes[-1][1]]
    assert edges[0] == 0 and edges[-1] == plan.total_bytes and edges == sorted(set(edges))
    assert all(a % 4096 == 0 and b - a <= per * 4096 for a, b in stripes)
    assert cut(plan, per, inside=False) == [
        (a, min(a + per * 4096, plan.total_bytes)) for a in range(0, plan.total_bytes, per * 4096)]
    into = fetcher._Into(plan, {})
    for v in plan.variables:
        own = (v.offset + v.nbytes) // 4096 - -(-v.offset // 4096)
        placed = [s for s in stripes if (t := into.target(*s)) is not None and t[1] == v.offset]
        for a, b in placed:
            assert v.offset <= a < b <= v.offset + v.nbytes
        if v.offset + v.nbytes < plan.total_bytes and own >= max(1, per // 8):
            assert sum(b - a for a, b in placed) == own * 4096, (v.name, own)
