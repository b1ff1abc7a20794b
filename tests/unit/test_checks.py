"""collective.check in one process: N ranks as threads over an all-gather through a barrier, and
the comparison (who differs, the majority, ties, names / dtypes / shapes that differ) on its own.
The real launchers (torchrun, mpiexec) are in tests/framework/test_torch_check.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import collective
from collective import errors as E
from collective.checks import compare, tensor_digests
from collective.errors import DivergenceError, UsageError


class Ranks:
    """``n`` ranks in threads; ``exchange(r)`` is rank r's all-gather of bytes. Records every
    payload each rank sent."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.slots: list[bytes | None] = [None] * n
        self.sent: list[list[bytes]] = [[] for _ in range(n)]
        self.barrier = threading.Barrier(n, timeout=30)

    def exchange(self, rank: int):
        def allgather(payload: bytes) -> list[bytes]:
            self.sent[rank].append(payload)
            self.slots[rank] = payload
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return allgather

    def run(self, values: list[dict], **kwargs) -> list:
        """check() on every rank at once: each rank's digest or exception."""
        out: list = [None] * self.n

        def one(r: int) -> None:
            try:
                out[r] = collective.check(values[r], exchange=self.exchange(r), **kwargs)
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                out[r] = exc

        threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a rank hung in check()"
        return out


def model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"layer.0.weight": rng.standard_normal((16, 8), dtype=np.float32),
            "layer.0.bias": rng.standard_normal(16, dtype=np.float32),
            "steps": np.array(7, dtype=np.int64)}


def one_ulp(values: dict, name: str, index: int = 0) -> dict:
    out = {k: v.copy() for k, v in values.items()}
    flat = out[name].reshape(-1)
    flat[index] = np.nextafter(flat[index], np.float32(np.inf))
    return out


def errors_of(results: list) -> list[DivergenceError]:
    assert all(isinstance(r, DivergenceError) for r in results), results
    assert len({str(r) for r in results}) == 1, "every rank must raise the same message"
    return results


def test_ranks_that_agree_share_one_digest_after_one_exchange_of_24_bytes():
    ranks = Ranks(4)
    results = ranks.run([model() for _ in range(4)], step=3)
    assert len(set(results)) == 1 and isinstance(results[0], str) and len(results[0]) == 32
    # Only the combined digest and the step travel: one exchange, 16 + 8 bytes, per rank.
    assert [len(p) for sent in ranks.sent for p in sent] == [24] * 4


def test_the_digest_follows_the_values_not_the_mappings_order():
    values = model()
    reordered = dict(reversed(list(values.items())))
    a, b = Ranks(1).run([values])[0], Ranks(1).run([reordered])[0]
    assert a == b
    assert Ranks(1).run([one_ulp(values, "layer.0.bias", 5)])[0] != a


def test_one_ulp_on_rank_2_fails_every_rank_naming_rank_2_and_the_tensor():
    values = [model() for _ in range(4)]
    values[2] = one_ulp(values[2], "layer.0.weight", 37)
    results = errors_of(Ranks(4).run(values, step=1200))
    err = results[0]
    assert str(err) == ("replicas differ at step 1200: 'layer.0.weight' on rank 2 differs from ranks 0,1,3 "
                        "(1 of 3 tensor(s) differ on 4 ranks)")
    assert (err.culprit, err.phase, err.ranks, err.tensors) == ("rank 2", "check", (2,), ("layer.0.weight",))
    assert err.exit_code == 1


def test_the_majority_is_the_reference_even_against_rank_0():
    values = [model() for _ in range(5)]
    values[0] = one_ulp(values[0], "layer.0.bias")
    values[3] = one_ulp(values[3], "layer.0.weight")
    err = errors_of(Ranks(5).run(values))[0]
    assert str(err) == ("replicas differ: 'layer.0.bias' on rank 0 differs from ranks 1,2,3,4; "
                        "'layer.0.weight' on rank 3 differs from ranks 0,1,2,4 (2 of 3 tensor(s) differ on 5 ranks)")
    assert err.culprit == "ranks 0,3" and err.ranks == (0, 3)


def test_on_a_tie_the_lowest_ranks_value_is_the_reference():
    values = [model(), model(), model(), model()]
    values[1] = one_ulp(values[1], "layer.0.bias")
    values[3] = values[1]
    err = errors_of(Ranks(4).run(values))[0]
    assert "'layer.0.bias' on ranks 1,3 differs from ranks 0,2" in str(err)
    assert err.culprit == "ranks 1,3"
    # Two ranks: the other one is named.
    err = errors_of(Ranks(2).run([model(), one_ulp(model(), "layer.0.bias")]))[0]
    assert "'layer.0.bias' on rank 1 differs from rank 0" in str(err)


def test_three_values_of_one_tensor_are_each_named():
    values = [model() for _ in range(4)]
    values[1] = one_ulp(values[1], "layer.0.bias", 0)
    values[2] = one_ulp(values[2], "layer.0.bias", 1)
    err = errors_of(Ranks(4).run(values))[0]
    assert ("'layer.0.bias' on rank 1 differs from ranks 0,3; 'layer.0.bias' on rank 2 differs from ranks 0,3"
            in str(err))
    assert err.tensors == ("layer.0.bias",) and err.ranks == (1, 2)


def test_same_bytes_under_another_dtype_or_shape_are_a_difference_that_says_so():
    base = {"w": np.zeros((2, 3), dtype=np.float32)}
    err = errors_of(Ranks(3).run([base, base, {"w": np.zeros((2, 3), dtype=np.int32)}]))[0]
    assert "'w' is <i4 (2, 3) on rank 2, <f4 (2, 3) on ranks 0,1" in str(err)
    err = errors_of(Ranks(3).run([base, {"w": np.zeros((3, 2), dtype=np.float32)}, base]))[0]
    assert "'w' is <f4 (3, 2) on rank 1, <f4 (2, 3) on ranks 0,2" in str(err)


def test_missing_and_extra_tensors_are_named_with_their_ranks():
    full = model()
    short = {k: v for k, v in full.items() if k != "steps"}
    err = errors_of(Ranks(3).run([full, full, short]))[0]
    assert "'steps' is missing on rank 2 (ranks 0,1 hold it)" in str(err)
    err = errors_of(Ranks(3).run([short, {**short, "extra": np.ones(1)}, short]))[0]
    assert "'extra' exists only on rank 1 (ranks 0,2 lack it)" in str(err)
    assert err.culprit == "rank 1" and err.tensors == ("extra",)


def test_many_differences_are_counted_past_the_first_eight():
    tables = [[(f"t{i:02d}", "<f4", (1,), "a" * 32) for i in range(20)],
              [(f"t{i:02d}", "<f4", (1,), "b" * 32) for i in range(20)]]
    err = compare(tables, step=5)
    assert str(err).count("differs from") == 8
    assert "and 12 more difference(s) (20 of 20 tensor(s) differ on 2 ranks)" in str(err)
    assert len(err.tensors) == 20 and compare([tables[0], tables[0]]) is None


def test_ranks_at_different_steps_are_told_so_on_every_rank():
    ranks = Ranks(2)
    out: list = [None, None]

    def one(r: int) -> None:
        try:
            collective.check(model(), step=10 * (r + 1), exchange=ranks.exchange(r))
        except Exception as exc:  # noqa: BLE001
            out[r] = exc

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(isinstance(e, UsageError) for e in out), out
    assert "called at different steps (rank 0: 10, rank 1: 20)" in str(out[0])


def test_a_divergence_error_crosses_the_wire_as_itself():
    err = compare([[("w", "<f4", (1,), "a" * 32)], [("w", "<f4", (1,), "b" * 32)]])
    back = E.rebuild(E.describe(err), err.code, str(err))
    assert type(back) is DivergenceError and (back.culprit, back.phase) == ("rank 1", "check")
    assert collective.DivergenceError is DivergenceError


def test_without_a_way_to_reach_the_other_ranks_the_error_says_what_to_do(monkeypatch):
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    dist = __import__("sys").modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    with pytest.raises(UsageError, match="init_process_group first, run under mpiexec .* or pass exchange="):
        collective.check(model())


@pytest.mark.parametrize(("values", "kwargs", "problem"), [
    ([1, 2], {}, "takes a mapping of name -> array, not list"),
    (type("Net", (), {"state_dict": lambda self: {}})(), {}, r"collective.torch.check_module\(module\)"),
    ({"x": np.array(["a"], dtype=object)}, {}, "variable 'x'"),
    ({"": np.zeros(1)}, {}, "is not a non-empty string"),
    (model(), {"step": -1}, "step must be a non-negative integer"),
    (model(), {"timeout": 0}, "timeout must be greater than 0"),
    (model(), {"exchange": "allgather"}, "exchange must be a callable"),
])
def test_bad_input_is_one_usage_error(values, kwargs, problem):
    kwargs.setdefault("exchange", lambda payload: [payload])
    with pytest.raises(UsageError, match=problem):
        collective.check(values, **kwargs)


def test_a_broken_exchange_is_a_protocol_error_not_a_crash():
    with pytest.raises(E.ProtocolError, match="not every rank's bytes"):
        collective.check(model(), exchange=lambda payload: [payload, None])
    with pytest.raises(E.ProtocolError, match="digest of another size"):
        collective.check(model(), exchange=lambda payload: [payload, b"short"])


def test_entries_bind_name_dtype_shape_and_bytes():
    (name, dtype, shape, digest), = tensor_digests({"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
    assert (name, dtype, shape) == ("w", "<f4", (2, 3))
    assert digest == tensor_digests({"v": np.arange(6, dtype=np.float32)})[0][3]  # the bytes' digest alone
