"""Soak: many rounds, each with a random fault, against a chief that lives in this process.

    python tests/soak.py --rounds 120 [--seed 1] [--workers 3]      (make soak)

Each round builds a fresh ChiefService behind a real gRPC endpoint on loopback and starts real
worker processes (python -m collective.worker, shrunk heartbeats). A fault from reliability cases 3-17 and
25 is injected through a thin handler wrapper (the chief is in-process, so it can, for example,
flip a bit in one worker's stream or SIGKILL a worker after its first chunk). After each round:
the outcome must be the expected one (success with digests equal to the model's, or a failure
whose message names the culprit), every worker process must have exited, and nothing may grow:
file descriptors, threads and RSS of this process are compared between the early and the late
rounds. Prints one line per round and a summary with detection times; exits 1 on any violation.

    python tests/soak.py --rounds 12                    (every fault once: test_soak_short.py)
    python tests/soak.py --rounds 5 --faults truncated_stream

RSS: a round's objects hold each other (the chief's service, its supervisor and rejoin
tracker point back at it; a gRPC server and its servicer; an aborted call's state and its
exception's frames), so they are freed only by a full collection, not when the round ends.
CPython runs one only when the objects that survived since the last exceed a quarter of all
long-lived ones, and the pages a round's pool threads freed stay in their malloc arenas: the
soak grew about 1 MiB a round without levelling off (69 MiB at round 1, 78 at round 9; 179-184
MiB at round 120). A long-lived process that runs rounds in turn releases each one when it
ends (``release_freed_memory``: a collection, then ``malloc_trim``), as this one now does after
every round; the leak check allows 32 MiB.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from collective._api import release_freed_memory  # noqa: E402
from collective.chief.service import ChiefService  # noqa: E402
from collective.config import Timeouts  # noqa: E402
from collective.digest import array_digest  # noqa: E402
from collective.errors import AbortedError  # noqa: E402
from collective.plan import with_bytes  # noqa: E402
from collective.transport.grpc import GrpcEndpoint  # noqa: E402
from tests.clusters import ArraySource, catch  # noqa: E402
from tests.procs import wait_until  # noqa: E402

HB = ["--heartbeat-interval", "0.3", "--heartbeat-timeout", "1.5", "--join-timeout", "20"]
TIMEOUTS = Timeouts(join=20, straggler_log=5, rpc=5, stall=5, ready=20, start=20, linger=3, status_grace=0,
                    heartbeat=0.3, lease=1.5)
TOKEN = "soak-token"

# fault -> (what the round must end in, words the chief's error must contain)
FAULTS = {
    "none": ("ok", None),
    "late_joiner": ("ok", None),
    "kill_mid_broadcast": ("fail", "lost during the broadcast"),
    "freeze_mid_broadcast": ("fail", "no heartbeat"),
    "kill_before_broadcast_and_restart": ("ok", None),
    # The frozen holder keeps its id (a restart may not take a live member's slot: only its
    # secret could prove it the same worker); the lease then names it.
    "restart_after_broadcast_began": ("fail", "no heartbeat"),
    "twin_id": ("ok", None),
    "wrong_token": ("ok", None),
    "declared_mismatch": ("ok", None),
    "corrupt_chunk": ("fail", "digest"),
    "truncated_stream": ("fail", "without its end message"),
    "chief_sigterm": ("fail", "chief shutting down"),
}


@dataclass
class Round:
    n: int
    fault: str
    outcome: str = ""
    error: str = ""
    detect_s: float | None = None
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


class FaultyHandler:
    """Delegates to the real service; injects this round's fault at the right moment."""

    def __init__(self, service: ChiefService, soak: Soak) -> None:
        self.s, self.soak = service, soak
        self.injected_at: float | None = None
        self._lock = threading.Lock()
        self.victim: str | None = None

    def __getattr__(self, name):
        return getattr(self.s, name)

    def _inject(self, action) -> None:
        with self._lock:
            if self.injected_at is None:
                self.injected_at = time.monotonic()
                action()

    def join(self, req, peer):
        reply = self.s.join(req, peer)
        fault = self.soak.fault
        if fault == "kill_before_broadcast_and_restart" and req.worker_id == self.victim:
            self._inject(lambda: self.soak.kill_and_restart(req.worker_id))
        return reply

    def stream_views(self, refs):
        """Where every stream passes (FetchRaw and Fetch alike): faults go in here."""
        [ref] = refs
        fault = self.soak.fault
        sent = 0
        for chunk, data in self.s.stream_views(refs):
            if ref.worker_id == self.victim:
                if fault == "corrupt_chunk" and len(data) and sent == 0:
                    flipped = bytearray(data)
                    flipped[len(flipped) // 2] ^= 0x04
                    data = memoryview(bytes(flipped))
                    self._inject(lambda: None)
                if fault == "truncated_stream" and chunk.HasField("end"):
                    self._inject(lambda: None)
                    return  # the sender returns early: no stream end
            yield chunk, data
            sent += 1
            if ref.worker_id == self.victim and sent == 1:
                if fault == "kill_mid_broadcast":
                    self._inject(lambda: self.soak.signal(ref.worker_id, signal.SIGKILL))
                elif fault == "freeze_mid_broadcast":
                    self._inject(lambda: self.soak.signal(ref.worker_id, signal.SIGSTOP))
                elif fault == "restart_after_broadcast_began":
                    self._inject(lambda: (self.soak.signal(ref.worker_id, signal.SIGSTOP),
                                          self.soak.start_worker(ref.worker_id)))
                elif fault == "chief_sigterm":
                    self._inject(lambda: threading.Thread(
                        target=self.s.fail, args=(AbortedError("chief shutting down (SIGTERM)"),),
                        daemon=True).start())

    def fetch(self, ref):
        yield from with_bytes(self.stream_views([ref]))


class Soak:
    def __init__(self, workers: int, rng: random.Random, tmp: Path) -> None:
        self.workers, self.rng, self.tmp = workers, rng, tmp
        self.procs: dict[str, list[subprocess.Popen]] = {}
        self.address = ""
        self.fault = "none"
        rng_np = np.random.default_rng(5)
        self.arrays = {
            "w": rng_np.standard_normal((256, 1024)).astype(np.float32),  # 1 MiB: several chunks
            "b": np.zeros(1024, np.float32),
            "step": np.array(0, np.int64),
        }
        self.digests = {k: array_digest(v) for k, v in self.arrays.items()}

    def start_worker(self, wid: str, *extra: str, token: str = TOKEN) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
        env["COLLECTIVE_TOKEN"] = token
        log = open(self.tmp / f"{wid}-{len(self.procs.get(wid, []))}.log", "w")  # noqa: SIM115
        p = subprocess.Popen([sys.executable, "-m", "collective.worker", "--chief", self.address, "--worker-id", wid, *HB, *extra],
                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=ROOT)
        log.close()
        self.procs.setdefault(wid, []).append(p)
        return p

    def signal(self, wid: str, sig: int) -> None:
        p = self.procs[wid][-1]
        if p.poll() is None:
            os.kill(p.pid, sig)

    def joined(self, wid: str, n: int) -> bool:
        """Whether process ``n`` of ``wid`` has its join reply (it logs so)."""
        return "waiting for the plan" in (self.tmp / f"{wid}-{n}.log").read_text()

    def kill_and_restart(self, wid: str) -> None:
        victim = self.procs[wid][-1]  # this round's process, whatever happens later
        n = len(self.procs[wid]) - 1

        def go():
            wait_until(lambda: self.joined(wid, n), f"{wid}'s join reply")  # killed after it, not before
            if victim.poll() is None:
                os.kill(victim.pid, signal.SIGKILL)
            victim.wait(10)
            wait_until(lambda: wid not in {w.worker_id for w in self.service.status().workers}, f"{wid}'s slot freed")
            self.start_worker(wid)

        helper = threading.Thread(target=go, daemon=True)
        helper.start()
        self.helpers.append(helper)  # only started threads: the round joins them

    def round(self, n: int, fault: str) -> Round:
        """``run_round``, then what it built released: its objects hold each other (the
        service and its supervisor, the server and its servicer), so a collection frees them."""
        r = self.run_round(n, fault)
        release_freed_memory()
        return r

    def run_round(self, n: int, fault: str) -> Round:
        r = Round(n, fault)
        self.fault, self.procs, self.helpers = fault, {}, []
        # star: the in-process chief streams to every worker itself, so it can inject faults
        service = self.service = ChiefService(ArraySource(self.arrays), self.workers, timeouts=TIMEOUTS, chunk_bytes=256 << 10,
                               topology="star")
        handler = FaultyHandler(service, self)
        ids = [f"w{i}" for i in range(self.workers)]
        handler.victim = self.rng.choice(ids)
        endpoint = GrpcEndpoint("127.0.0.1:0", token=TOKEN)  # sized from the service it wraps
        self.address = endpoint.start(handler)
        t0 = time.monotonic()
        outcome: list = []
        sup = threading.Thread(target=lambda: outcome.append(catch(service.supervise)), daemon=True)
        sup.start()
        try:
            order = list(ids)
            if fault == "late_joiner":
                late = order.pop()
            if fault == "kill_before_broadcast_and_restart":
                # The victim joins alone, is killed and restarted; only then do the others join,
                # so its death always falls before the broadcast.
                order.remove(handler.victim)
                self.start_worker(handler.victim)
                wait_until(lambda: self.helpers, "the kill-and-restart helper")
                for t in self.helpers:
                    t.join(20)
                    if t.is_alive():
                        raise AssertionError("the kill-and-restart helper did not finish within 20 s")
            for wid in order:
                self.start_worker(wid)
            if fault == "late_joiner":
                time.sleep(1.0)  # the scenario itself (several heartbeats pass), not a synchronisation
                self.start_worker(late)
            if fault == "twin_id":
                wait_until(lambda: self.joined(handler.victim, 0), "the first twin's join")
                self.start_worker(handler.victim)  # refused: the first keeps its rank
            if fault == "wrong_token":
                self.start_worker("intruder", token="not-the-token")
            if fault == "declared_mismatch":
                spec = self.tmp / "other.yaml"
                spec.write_text("variables:\n  - {name: w, shape: [1024, 256], dtype: float32, initializer: zeros}\n")
                self.start_worker("odd", "--expect-model", str(spec))
            sup.join(60)
            if sup.is_alive():
                r.problems.append("supervise() did not return within 60 s")
            err = outcome[0] if outcome else None
            r.outcome = "ok" if err is None else "fail"
            r.error = str(err or "")
            r.seconds = time.monotonic() - t0
            if handler.injected_at is not None and r.outcome == "fail" and service.state.phase_at:
                r.detect_s = max(0.0, service.state.phase_at - handler.injected_at)
            want, words = FAULTS[fault]
            if r.outcome != want:
                r.problems.append(f"expected {want}, got {r.outcome}: {r.error}")
            elif words and words not in r.error:
                r.problems.append(f"error does not say {words!r}: {r.error}")
            if want == "fail" and handler.victim not in r.error and fault != "chief_sigterm":
                r.problems.append(f"error does not name the culprit {handler.victim}: {r.error}")
            if r.outcome == "ok":
                res = service.result()
                if {v["name"]: v["digest"] for v in res["variables"]} != self.digests:
                    r.problems.append("digests differ from the model's")
                if len({w["digest"] for w in res["workers"]}) != 1:
                    r.problems.append("workers' digests differ")
        finally:
            for t in self.helpers:
                t.join(15)
            for ps in self.procs.values():
                for p in ps:
                    if p.poll() is None:
                        try:
                            os.kill(p.pid, signal.SIGCONT)
                        except ProcessLookupError:
                            pass
            deadline = time.monotonic() + 15
            for wid, ps in self.procs.items():
                for p in ps:
                    try:
                        code = p.wait(max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        r.problems.append(f"worker {wid} (pid {p.pid}) still running after the round; killed")
                        p.kill()
                        p.wait(10)
                        continue
                    if r.outcome == "ok" and code != 0 and not (
                        fault in ("twin_id", "kill_before_broadcast_and_restart") and p is not ps[-1] or
                        fault == "twin_id" and wid == handler.victim
                    ) and wid not in ("intruder", "odd"):
                        r.problems.append(f"worker {wid} exited {code} in a successful round")
                    if r.outcome == "fail" and code == 0:
                        r.problems.append(f"worker {wid} exited 0 in a failed round")
            endpoint.stop(grace=0.5)
            self.service = None
        return r


def usage(settle: float = 5.0) -> tuple[int, int, float]:
    """Descriptors, threads and RSS (MiB) of this process, once the round's own threads have
    ended (up to ``settle`` s): a sample counts what stays, not what is still on its way out
    (gRPC's pool, the chief's cause-awaiting threads)."""
    deadline = time.monotonic() + settle
    while threading.active_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/statm") as fh:
        rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return fds, threading.active_count(), rss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=120)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--faults", default="", help="comma-separated faults to draw from (default: every one); "
                    "the first rounds take each in turn, so --rounds N >= their count covers each once")
    args = ap.parse_args()
    import logging

    logging.getLogger().setLevel(logging.CRITICAL)  # the round lines below say what happened
    rng = random.Random(args.seed)
    faults = [f for f in args.faults.split(",") if f] or list(FAULTS)
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        ap.error(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULTS)}")
    with tempfile.TemporaryDirectory(prefix="collective-soak-") as tmp:
        soak = Soak(args.workers, rng, Path(tmp))
        rounds, samples = [], []
        for n in range(1, args.rounds + 1):
            fault = faults[(n - 1) % len(faults)] if n <= len(faults) else rng.choice(faults)
            r = soak.round(n, fault)
            rounds.append(r)
            samples.append(usage())
            fds, threads, rss = samples[-1]
            flag = "OK " if not r.problems else "BAD"
            detect = f" detected in {r.detect_s:.3f} s" if r.detect_s is not None else ""
            print(f"{flag} round {n:3d} {fault:<34} {r.outcome:<4} {r.seconds:5.2f} s{detect}; fds {fds} threads {threads} "
                  f"rss {rss:.0f} MiB" + (f" | {'; '.join(r.problems)}" if r.problems else ""), flush=True)
    bad = [r for r in rounds if r.problems]
    skip = min(5, len(samples) // 4)  # the first rounds warm up (imports, pools); short soaks compare less
    early, late = samples[skip:skip + 10], samples[-10:]
    growth = [statistics.mean(x[i] for x in late) - statistics.mean(x[i] for x in early) for i in range(3)]
    print(f"\n{len(rounds)} rounds, {len(bad)} with problems; faults: "
          + ", ".join(f"{f} {sum(r.fault == f for r in rounds)}" for f in faults))
    for f in faults:
        times = [r.detect_s for r in rounds if r.fault == f and r.detect_s is not None]
        if times:
            print(f"  {f:<34} detection {min(times):.3f}-{max(times):.3f} s (median {statistics.median(times):.3f})")
    print("threads at the end: " + ", ".join(sorted(t.name for t in threading.enumerate())))
    print(f"growth from rounds 6-15 to the last 10: fds {growth[0]:+.1f}, threads {growth[1]:+.1f}, rss {growth[2]:+.1f} MiB")
    leak = growth[0] > 5 or growth[1] > 3 or growth[2] > 32
    if leak:
        print("LEAK: resource use grew")
    print(f"soak: {len(rounds) - len(bad)} passed, {len(bad)} failed")
    return 1 if bad or leak else 0


if __name__ == "__main__":
    sys.exit(main())
