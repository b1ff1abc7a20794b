"""collective.fetch against hostile holders (tests/fetch_hostile_holder.py: the project's own
publish, plan and chunk code, bent) over real gRPC on 127.0.0.1: a plan streamed past its claim,
a claimed size never sent, a provisional plan over forged bytes, chunk digests that contradict
the manifest, 1-byte chunks, a holder that trickles one byte a second beside an honest one, one
that sends a chunk just inside every stall timeout beside an honest one, and
2,000 sources for one fetch. The fetcher runs in a process of its own where its memory is
measured (its peak RSS: ``VmHWM``, not ``ru_maxrss``, which Linux carries over an exec from the
forked copy of pytest's memory, so it read 425 MiB after memory-heavy tests ran first)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import numpy as np
import pytest

import collective
from collective.digest import array_digest
from collective.snapshot import tree
from tests.clusters import TOKEN
from tests.procs import Proc, start_holder

pytestmark = pytest.mark.integration

# The fetcher's process: one RESULT line (JSON) with the outcome, its seconds and its peak RSS.
FETCHER = """
import json, sys, time
import collective
from collective.chief.reports import peak_rss_bytes
from collective.digest import array_digest
from collective.snapshot import tree
sources, step, stall, timeout, manifest = sys.argv[1].split(","), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
t0 = time.monotonic()
try:
    got = collective.fetch(sources, step=step, timeout=timeout, stall_timeout=stall, manifest=manifest or None, shm=False)
    out = {"error": None, "manifest": got.manifest_digest, "stats": got.stats,
           "digests": {n: array_digest(a) for n, a in tree.flatten(got)[1].items()}}
except collective.CollectiveError as exc:
    out = {"error": type(exc).__name__, "message": str(exc)}
out["seconds"] = round(time.monotonic() - t0, 2)
out["maxrss_mib"] = round(peak_rss_bytes() / 2**20)
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.fixture
def holders(tmp_path):
    """start(attack, *args) -> (address, the honest state's digests and manifest, Proc) of a new
    holder process, named h0, h1, ... in order; all killed by pid."""
    started: list[Proc] = []

    def start(attack: str, *args: str) -> tuple[str, dict, Proc]:
        return start_holder(tmp_path, started, "tests.fetch_hostile_holder", ("--attack", attack, *args), TOKEN)

    yield start
    for proc in started:
        proc.kill()


def fetch_in_process(tmp_path, sources: list[str], *, stall: float, timeout: float, manifest: str = "") -> dict:
    """Run FETCHER in a process of its own (killed by pid); its RESULT."""
    proc = Proc(["-c", FETCHER, ",".join(sources), "8", str(stall), str(timeout), manifest],
                tmp_path / f"fetcher-{time.monotonic_ns()}.log", env={"COLLECTIVE_TOKEN": TOKEN})
    try:
        rc = proc.wait(timeout + 60)
        out = proc.output()
    finally:
        proc.kill()
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert rc == 0 and lines, f"fetcher exited {rc}:\n{out}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_a_plan_streamed_past_its_claim_is_refused_at_the_piece_that_passes_it(holders, tmp_path):
    # The holder's pieces claim an 8 MiB plan and keep coming: 512 MiB in 128 pieces. Refused at
    # the third piece (the one past 8 MiB), the call cancelled: the holder gets to send a few
    # more at most (gRPC's flow-control window), and the fetcher never holds them all.
    address, _, proc = holders("flood", "--flood-mib", "512")
    got = fetch_in_process(tmp_path, [address], stall=30, timeout=60)
    assert got["error"] == "ProtocolError", got
    assert re.search(r"sent a Plan in pieces that claim 8388608 bytes after 8388608 \(at most \d+\) and carry 12582912$",
                     got["message"]), got
    time.sleep(1.0)  # what the holder still sends after the cancel is printed by then
    sent = max(int(n) for n in re.findall(r"plan piece (\d+)", proc.output()))
    assert sent < 32, f"the holder sent {sent} of 128 pieces of 4 MiB"
    assert got["maxrss_mib"] < 400, got


def test_a_claimed_size_commits_memory_only_as_its_stripes_are_asked_for(holders, tmp_path):
    # A consistent plan claiming 2 GiB, whose stream never sends a byte: the fetch fails at the
    # stall timeout having committed one stripe (64 MiB), not the 2 GiB claimed.
    address, _, _ = holders("claim", "--kib", "4", "--claim-mib", "2048", "--chunk-bytes", str(4 << 20))
    got = fetch_in_process(tmp_path, [address], stall=3, timeout=60)
    assert got["error"] == "FetchError", got
    assert "sent nothing for 3 s" in got["message"], got
    assert got["maxrss_mib"] < 512, got


def test_a_provisional_plan_over_forged_bytes_is_refused(holders, tmp_path):
    # digests_follow with no digests: the only digests are the trailers the holder computes of
    # its own forged bytes. Nothing any plan digest covers: refused before a byte is taken.
    address, _, _ = holders("follow")
    got = fetch_in_process(tmp_path, [address], stall=10, timeout=60)
    assert got["error"] == "ProtocolError", got
    assert got["message"] == (f"holder h0 at {address} sent a plan without its digests (digests_follow); a fetch "
                              f"takes only bytes its plan's digests cover"), got


def test_chunk_digests_over_forged_bytes_under_the_honest_manifest_are_refused(holders, tmp_path):
    # The holder's variable digests (hence its manifest) are the honest state's, its chunk
    # digests those of forged bytes: every chunk checks, the manifest given matches, and the
    # variable's own digest is what refuses it.
    address, published, _ = holders("forged")
    got = fetch_in_process(tmp_path, [address], stall=10, timeout=60, manifest=published["manifest"])
    assert got["error"] == "IntegrityError", got
    assert got["message"].startswith(f"holder h0 at {address}: the bytes of 'block.0.weight' match the plan's "
                                     f"chunk digests but not its own digest"), got


def test_a_plan_of_one_byte_chunks_is_refused_before_allocating(holders, tmp_path):
    address, _, _ = holders("fine", "--kib", "256")
    got = fetch_in_process(tmp_path, [address], stall=10, timeout=120)
    assert got["error"] == "ProtocolError", got
    assert re.fullmatch(rf"holder h0 at {re.escape(address)} sent a plan of \d+ chunks of 1 bytes: chunks below "
                        r"64 KiB are for states of at most 1024 chunks; refused before allocating", got["message"]), got


def test_publish_refuses_chunks_below_the_floor_for_all_but_a_small_state():
    with pytest.raises(collective.UsageError, match=r"^chunk_bytes=4096 cuts this state of \d+ bytes into 102[56] chunks of 4096 bytes: chunks below 64 KiB"):
        collective.publish({"x": np.zeros(1025 * 1024, np.float32)}, step=1, bind="127.0.0.1:0", token=TOKEN,
                           chunk_bytes=4096)
    with collective.publish({"x": np.arange(64.0)}, step=1, bind="127.0.0.1:0", token=TOKEN, chunk_bytes=256) as pub:
        assert np.array_equal(collective.fetch(pub.address, step=1, token=TOKEN, timeout=30)["x"], np.arange(64.0))


@pytest.mark.timeout(240)
def test_a_trickling_holder_beside_an_honest_one_is_dropped_and_its_stripe_retaken(holders, tmp_path):
    # One byte a second keeps its connection alive (no silence), yet its stripe verifies no
    # chunk: after the stall timeout it is dropped and the honest holder serves everything.
    trickle, _, _ = holders("trickle", "--mib", "16")
    honest, published, _ = holders("none", "--mib", "16")
    got = fetch_in_process(tmp_path, [trickle, honest], stall=3, timeout=120)
    assert got["error"] is None, got
    assert got["digests"] == published["digests"] and got["manifest"] == published["manifest"]
    dropped = got["stats"][trickle]["dropped"]
    assert "delivered no verified chunk for 3 s" in dropped, got["stats"]
    assert got["stats"][honest]["bytes"] + got["stats"][trickle]["bytes"] >= 16 << 20


@pytest.mark.timeout(240)
def test_a_holder_far_below_the_other_yet_never_stalled_is_dropped_and_its_stripe_retaken(holders, tmp_path):
    # One 64 KiB chunk every 3 s, inside the 5 s stall timeout: never stalled. Before, it kept
    # its stripe (32 chunks) to the end: the fetch took 96 s, the slow holder never dropped. Now
    # its rate over its last seconds of streaming is far below the honest holder's: it is
    # dropped and the honest holder retakes its stripe.
    slow, _, _ = holders("slow", "--mib", "16", "--chunk-bytes", str(64 << 10), "--slow-seconds", "3")
    honest, published, _ = holders("none", "--mib", "16", "--chunk-bytes", str(64 << 10))
    got = fetch_in_process(tmp_path, [slow, honest], stall=5, timeout=150)
    assert got["error"] is None, got
    assert got["digests"] == published["digests"] and got["manifest"] == published["manifest"]
    dropped = got["stats"][slow]["dropped"]
    assert dropped and "ran far below the other holders" in dropped, got["stats"]
    assert got["stats"][honest]["dropped"] is None, got["stats"]
    assert got["stats"][slow]["bytes"] < 2 << 20 <= got["stats"][honest]["bytes"], got["stats"]


@pytest.mark.timeout(240)
def test_a_spare_takes_over_from_a_dropped_holder(holders, monkeypatch):
    # At most one holder at a time: the second source is a spare, asked for its plan only once
    # the first (trickling) is dropped, and then serves the rest.
    from collective.snapshot import fetcher

    monkeypatch.setattr(fetcher, "MAX_ACTIVE_HOLDERS", 1)
    trickle, _, _ = holders("trickle", "--mib", "4")
    honest, published, _ = holders("none", "--mib", "4")
    got = collective.fetch([trickle, honest], step=8, token=TOKEN, timeout=120, stall_timeout=3, shm=False)
    _, arrays = tree.flatten(got)
    assert {n: array_digest(a) for n, a in arrays.items()} == published["digests"]
    assert "delivered no verified chunk" in got.stats[trickle]["dropped"], got.stats
    assert got.stats[honest]["bytes"] > 0 and got.stats[honest]["dropped"] is None, got.stats


def _threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


@pytest.mark.timeout(240)
def test_two_thousand_sources_start_a_bounded_number_of_threads(holders):
    # One honest holder and 1,999 addresses that refuse connections (bound, not listening):
    # plans are asked by at most MAX_ACTIVE_HOLDERS threads, and a fetch that found a holder
    # among the first of them leaves the rest as spares, never dialled.
    honest, published, _ = holders("none", "--mib", "2")
    dead = []
    try:
        for _ in range(1999):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            dead.append(s)
        sources = [honest] + [f"127.0.0.1:{s.getsockname()[1]}" for s in dead]
        base, peak, stop = _threads(), [0], threading.Event()

        def sample() -> None:
            while not stop.wait(0.005):
                peak[0] = max(peak[0], _threads())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            got = collective.fetch(sources, step=8, token=TOKEN, timeout=120, stall_timeout=10, shm=False)
        finally:
            stop.set()
            sampler.join(10)
    finally:
        for s in dead:
            s.close()
    _, arrays = tree.flatten(got)
    assert {n: array_digest(a) for n, a in arrays.items()} == published["digests"]
    # MAX_ACTIVE_HOLDERS (8) askers, then as many stripe threads, and gRPC's own: far from 2,000
    assert peak[0] - base <= 32, f"{peak[0] - base} threads beside the {base} there were"
