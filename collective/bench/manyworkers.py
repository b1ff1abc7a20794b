"""Many workers in one process, for the scale test and ``collective bench scale``.

``python -m collective.bench.manyworkers --chief HOST:PORT --workers K [--prefix w] [--first R]``
runs K workers of the project's own worker code (``collective.join``: the agent, its heartbeat
and presence calls, its relay) as K threads of this process, ids ``<prefix><first>`` ...
``<prefix><first+K-1>``. ``--ready-file F``: touched once the imports are done; ``--go-file G``:
every join waits until G exists and then until the ``time.time()`` it holds, so the workers of
several such processes join at once (a join storm). ``--no-relay``: the workers
relay to nobody (the chief then streams to each: a star). Prints one JSON line, then exits 0
if every worker's round started, 1 if not:
``{"workers": K, "started": n, "digests": [distinct worker digests], "errors": [first few]}``.

A benchmark harness: one process with K workers holds K connections to the chief and K relay
servers, where a deployment has one worker per process.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import threading
import time


def wait_go(go_file: str, deadline: float) -> None:
    """Until ``go_file`` exists (at most ``deadline`` s), then until the time it holds."""
    end = time.monotonic() + deadline
    while not os.path.exists(go_file):
        if time.monotonic() > end:
            raise SystemExit(f"manyworkers: no go file {go_file} within {deadline:g} s")
        time.sleep(0.01)
    time.sleep(max(0.0, float(open(go_file).read()) - time.time()))


def run_workers(chief: str, ids: list[str], *, token: str | None, relay: bool, deadline: float) -> dict:
    """Join ``ids`` to ``chief`` at once, each in a thread; what became of them."""
    import collective

    results: dict[str, object] = {}
    lock = threading.Lock()

    def one(worker_id: str) -> None:
        try:
            # The relay on the chief's own address, not "localhost" (both loopbacks at one port,
            # picked free on each and then bound: 64 relays per process picking at once, beside
            # the raw data ports of others, lost that race under load and served on ::1 only).
            out = collective.join(chief, worker_id=worker_id, token=token, devices="cpu:0",
                                  relay_host=chief.rpartition(":")[0] if relay else None)
            value: object = out.worker_digest
        except BaseException as exc:  # noqa: BLE001 - reported in the summary, one line each
            value = exc
        with lock:
            results[worker_id] = value

    threads = [threading.Thread(target=one, args=(w,), name=f"worker-{w}", daemon=True) for w in ids]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    digests = sorted({v for v in results.values() if isinstance(v, str)})
    errors = [f"{w}: {type(v).__name__}: {v}" for w, v in results.items() if not isinstance(v, str)]
    missing = [w for w in ids if w not in results]
    errors += [f"{w}: still running after {deadline:g} s" for w in missing]
    return {"workers": len(ids), "started": sum(isinstance(v, str) for v in results.values()),
            "digests": digests, "errors": errors[:5], "failed": len(errors)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m collective.bench.manyworkers", description=__doc__.split("\n\n")[0])
    p.add_argument("--chief", required=True, metavar="HOST:PORT")
    p.add_argument("--workers", type=int, required=True, metavar="K")
    p.add_argument("--prefix", default="w")
    p.add_argument("--first", type=int, default=0, metavar="R", help="the first worker's number")
    p.add_argument("--token", default=None)
    p.add_argument("--ready-file", default=None, metavar="F", help="touch F once ready to join")
    p.add_argument("--go-file", default=None, metavar="G", help="join once G exists, at the time.time() it holds")
    p.add_argument("--no-relay", action="store_true", help="relay to nobody (the chief streams to each)")
    p.add_argument("--deadline", type=float, default=600.0, metavar="S", help="give up after S seconds")
    args = p.parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 PID: every thread's stack, to see what a hung run waits for
    if args.workers < 1:
        p.error("--workers must be at least 1")
    # Imports before the go time: a storm of joins, not of imports.
    import collective._api  # noqa: F401
    import collective.transport.grpc  # noqa: F401
    import collective.worker.agent  # noqa: F401

    ids = [f"{args.prefix}{i}" for i in range(args.first, args.first + args.workers)]
    if args.ready_file:
        open(args.ready_file, "w").close()
    if args.go_file:
        wait_go(args.go_file, args.deadline)
    out = run_workers(args.chief, ids, token=args.token, relay=not args.no_relay, deadline=args.deadline)
    print(json.dumps(out), flush=True)
    return 0 if out["started"] == args.workers and len(out["digests"]) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
