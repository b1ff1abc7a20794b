"""xxh3-128 digests of arrays, bytes and ordered (name, digest) lists (collective.digest)."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from collective.digest import (
    array_digest,
    bytes_digest,
    chunk_digests,
    combined_digest,
    worker_digest,
)


def reference(a: np.ndarray) -> str:
    """The documented recipe: xxh3-128 of the C-contiguous bytes."""
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(a).tobytes())


BASE = np.arange(24, dtype=np.float32).reshape(4, 6)

ARRAYS = {
    "contiguous": BASE,
    "strided rows": BASE[::2],
    "strided columns": BASE[:, 1::2],
    "transposed": BASE.T,
    "reversed": BASE[::-1, ::-1],
    "fortran order": np.asfortranarray(BASE),
    "big-endian": np.arange(10, dtype=">i8"),
    "big-endian strided": np.arange(20, dtype=">f8")[::3],
    "0-d": np.array(3.5),
    "0-d big-endian": np.array(7, dtype=">u4"),
    "empty": np.zeros((0, 3), np.float32),
    "empty middle dim": np.zeros((2, 0, 5), ">c16"),
    "bool": np.array([True, False, True]),
    "complex": np.array([1 + 2j, -0.0 - 1j], np.complex64),
    "nan and -0.0": np.array([np.nan, -0.0, 0.0, -np.inf], np.float16),
}


@pytest.mark.parametrize("array", ARRAYS.values(), ids=ARRAYS.keys())
def test_array_digest_is_xxh3_128_of_the_c_contiguous_bytes(array):
    assert array_digest(array) == reference(array)


def test_array_digest_of_an_empty_array_is_the_digest_of_no_bytes():
    assert array_digest(np.zeros((0, 3), np.float32)) == xxhash.xxh3_128_hexdigest(b"")


def test_array_digest_of_a_0d_array_covers_its_single_element():
    assert array_digest(np.array(7, "<i4")) == xxhash.xxh3_128_hexdigest(b"\x07\x00\x00\x00")


def test_array_digest_of_a_view_follows_logical_order_not_memory_order():
    # The transposed view shares memory with BASE; its digest must be that of its own copy.
    assert array_digest(BASE.T) == array_digest(BASE.T.copy())
    assert array_digest(BASE.T) != array_digest(BASE)


def test_array_digest_depends_on_byte_order():
    little, big = np.arange(4, dtype="<i4"), np.arange(4, dtype=">i4")
    assert np.array_equal(little, big)
    assert array_digest(little) != array_digest(big)
    assert array_digest(big) == xxhash.xxh3_128_hexdigest(big.tobytes())


def test_array_digest_distinguishes_negative_zero_from_zero():
    assert array_digest(np.array([-0.0])) != array_digest(np.array([0.0]))


def test_array_digest_is_a_32_character_hex_string():
    d = array_digest(BASE)
    assert len(d) == 32
    int(d, 16)


def test_bytes_digest_is_xxh3_128_of_the_bytes():
    assert bytes_digest(b"abc") == xxhash.xxh3_128_hexdigest(b"abc")
    assert bytes_digest(memoryview(b"abc")) == xxhash.xxh3_128_hexdigest(b"abc")


def manual_combined(pairs) -> str:
    def field(text: str) -> bytes:
        b = text.encode()
        return len(b).to_bytes(8, "little") + b

    return xxhash.xxh3_128_hexdigest(b"".join(field(n) + field(d) for n, d in pairs))


def test_combined_digest_hashes_length_prefixed_name_and_digest_for_each_pair():
    pairs = [("w", "d1"), ("w/replica_1", "d1"), ("b", "d2")]
    assert combined_digest(pairs) == manual_combined(pairs)


def test_combined_digest_of_nothing_is_the_digest_of_no_bytes():
    assert combined_digest([]) == xxhash.xxh3_128_hexdigest(b"")


def test_combined_digest_is_order_sensitive():
    pairs = [("a", "d1"), ("b", "d2")]
    assert combined_digest(pairs) != combined_digest(list(reversed(pairs)))


def test_combined_digest_accepts_any_iterable_and_is_deterministic():
    pairs = [("a", "d1"), ("b", "d2")]
    assert combined_digest(iter(pairs)) == combined_digest(pairs)


def test_combined_digest_separates_name_from_digest():
    assert combined_digest([("ab", "c")]) != combined_digest([("a", "bc")])


def test_combined_digest_changes_when_a_digest_changes():
    assert combined_digest([("a", "d1")]) != combined_digest([("a", "d2")])


def test_combined_digest_distinguishes_lists_whose_names_contain_the_separators():
    one_pair = [("a\0x\nb", "y")]
    two_pairs = [("a", "x"), ("b", "y")]
    assert combined_digest(one_pair) != combined_digest(two_pairs)


def test_chunk_digests_hash_each_slice_and_a_shorter_last_one():
    data = np.arange(1000, dtype=np.uint16).view(np.uint8)  # 2000 bytes
    want = [xxhash.xxh3_128_hexdigest(data[i : i + 768].tobytes()) for i in (0, 768, 1536)]
    assert chunk_digests(data, 768) == want
    assert chunk_digests(data[:0], 768) == []


def test_chunk_digests_change_only_in_the_chunk_whose_byte_changed():
    data = np.zeros(4096, np.uint8)
    before = chunk_digests(data, 1024)
    data[2500] = 1
    after = chunk_digests(data, 1024)
    assert [a != b for a, b in zip(before, after, strict=True)] == [False, False, True, False]


def test_worker_digest_binds_the_manifest_the_replica_count_and_the_order_of_chunks():
    a, b = ["d1", "d2"], ["d2", "d1"]
    base = worker_digest("m", [a])
    assert base == worker_digest("m", [list(a)])
    assert base != worker_digest("other manifest", [a])
    assert base != worker_digest("m", [a, a])
    assert base != worker_digest("m", [b])
    # Two replicas of one chunk each are not one replica of two chunks.
    assert worker_digest("m", [["d1"], ["d2"]]) != worker_digest("m", [["d1", "d2"]])
