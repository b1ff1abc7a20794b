"""The element-level delta codec's cost (collective/delta.py): wire bytes as a share of the
state, and the seconds of one core to make a delta, apply it in place and verify the chunks it
touched, for a bf16 state of a given size with a given share of its elements changed uniformly
at random (issue 38's goals: 1 GiB at 1%: make <= 0.5 s, apply + verify <= 0.3 s).

    python -m tools.delta_bench --sizes 256MiB 1GiB --densities 0.001 0.01 0.05 0.3

The state is one tensor per 64 MiB (a model's large matrices), laid out as a published state.
"apply" parses and checks each delta's wire form, then writes it in place; "verify" finds the
4 MiB chunks the deltas touched and compares their digests with the new state's. Seconds are
CPU seconds of this one-threaded process (``time.process_time``: one core's work, what the goals
count, and less disturbed by other processes than wall time), wall seconds beside them; each
the best of ``--repeat`` runs. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from collective import delta as dl
from collective.digest import chunk_digests
from collective.plan import DEFAULT_CHUNK_BYTES, layout
from collective.sizes import format_bytes, parse_size

TENSOR_BYTES = 64 << 20


def _state(total: int, density: float, rng: np.random.Generator) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(base, new): bf16 tensors as uint16 views of ``total`` bytes, ``density`` of the
    elements of ``new`` changed (to another value) at random positions."""
    base, new = [], []
    for lo in range(0, total, TENSOR_BYTES):
        n = min(TENSOR_BYTES, total - lo) // 2
        a = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        b = a.copy()
        for lo in range(0, n, 1 << 22):  # a block at a time: no full-size float temporary
            part = b[lo : lo + (1 << 22)]
            where = np.flatnonzero(rng.random(part.size) < density)
            part[where] ^= rng.integers(1, 1 << 16, where.size, dtype=np.uint16)
        base.append(a)
        new.append(b)
    return base, new


def _clocks() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def _since(t: tuple[float, float]) -> tuple[float, float]:
    now = _clocks()
    return now[0] - t[0], now[1] - t[1]


def _best(fn, repeat: int) -> tuple[tuple[float, float], object]:
    best, out = (float("inf"), float("inf")), None
    for _ in range(repeat):
        t = _clocks()
        out = fn()
        best = min(best, _since(t))
    return best, out


def run(total: int, density: float, repeat: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict:
    rng = np.random.default_rng(38)
    base, new = _state(total, density, rng)
    offsets, arena_bytes = layout(new)
    make_s, deltas = _best(lambda: [dl.make_delta(a, b) for a, b in zip(base, new, strict=True)], repeat)
    wires = [d.to_bytes() for d in deltas]
    wire = sum(len(w) for w in wires)
    # The publisher's digests of the step: the new state's chunks (what the plan would list).
    arena = np.zeros(arena_bytes, dtype=np.uint8)
    for off, b in zip(offsets, new, strict=True):
        arena[off : off + b.nbytes] = b.view(np.uint8)
    expected = chunk_digests(arena, chunk_bytes)
    del arena
    targets = [a.copy() for a in base]
    apply_s = verify_s = (float("inf"), float("inf"))
    for _ in range(repeat):
        for t, a in zip(targets, base, strict=True):
            t[...] = a
        t0 = _clocks()  # apply: parse and check every delta, then write it in place
        parsed = [dl.parse_delta(w, size=t.size, itemsize=2) for t, w in zip(targets, wires, strict=True)]
        for t, d in zip(targets, parsed, strict=True):
            dl.apply_delta(t, d)
        apply_t, t1 = _since(t0), _clocks()  # verify: the touched chunks against the step's digests
        touched = dl.state_touched_chunks(parsed, offsets, chunk_bytes)
        bad = dl.mismatched_chunks(targets, chunk_bytes, touched, [expected[c] for c in touched],
                                   offsets=offsets, total=arena_bytes)
        verify_t = _since(t1)
        if bad:
            raise SystemExit(f"delta_bench: chunks {bad[:5]} differ after applying")
        apply_s, verify_s = min(apply_s, apply_t), min(verify_s, verify_t)
    kinds = {k: sum(d.kind == k for d in deltas) for k in (dl.SAME, dl.ELEMENTS, dl.WHOLE)}
    return {"bytes": total, "density": density, "wire": wire, "wire_pct": 100 * wire / total,
            "make_s": make_s, "apply_s": apply_s, "verify_s": verify_s, "touched": int(touched.size),
            "chunks": len(expected), "kinds": kinds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.delta_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["256MiB", "1GiB"])
    p.add_argument("--densities", nargs="+", type=float, default=[0.001, 0.01, 0.05, 0.3])
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    print("Seconds: CPU (wall)")
    print("| state | changed | wire (% of state) | make s | apply s | verify s | apply+verify s | chunks touched |")
    print("|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        for density in args.densities:
            r = run(parse_size(size), density, args.repeat)
            both = (r["apply_s"][0] + r["verify_s"][0], r["apply_s"][1] + r["verify_s"][1])
            secs = " | ".join(f"{c:.3f} ({w:.3f})" for c, w in (r["make_s"], r["apply_s"], r["verify_s"], both))
            print(f"| {format_bytes(r['bytes'])} | {100 * density:g}% | {format_bytes(r['wire'])} ({r['wire_pct']:.2f}%) "
                  f"| {secs} | {r['touched']}/{r['chunks']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
