"""Many workers in one process, for the scale test and ``collective bench scale``.

``python -m tools.bench.manyworkers --chief HOST:PORT --workers K [--prefix w] [--first R]``
runs K workers of the project's own worker code (``collective.join``: the agent, its heartbeat
and presence calls, its relay) as K threads of this process, ids ``<prefix><first>`` ...
``<prefix><first+K-1>``. ``--go T`` (a ``time.time()``) holds every join until T, so the
workers of several such processes join at once (a join storm). ``--no-relay``: the workers
relay to nobody (the chief then streams to each: a star). Prints one JSON line, then exits 0
if every worker's round started, 1 if not:
``{"workers": K, "started": n, "digests": [distinct worker digests], "errors": [first few]}``.

A benchmark harness: one process with K workers holds K connections to the chief and K relay
servers, where a deployment has one worker per process.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time


def run_workers(chief: str, ids: list[str], *, token: str | None, relay: bool, go: float | None,
                deadline: float) -> dict:
    """Join ``ids`` to ``chief`` at once, each in a thread; what became of them."""
    import collective

    results: dict[str, object] = {}
    lock = threading.Lock()

    def one(worker_id: str) -> None:
        try:
            out = collective.join(chief, worker_id=worker_id, token=token, devices="cpu:0",
                                  relay_host="auto" if relay else None)
            value: object = out.worker_digest
        except BaseException as exc:  # noqa: BLE001 - reported in the summary, one line each
            value = exc
        with lock:
            results[worker_id] = value

    threads = [threading.Thread(target=one, args=(w,), name=f"worker-{w}", daemon=True) for w in ids]
    if go is not None:
        time.sleep(max(0.0, go - time.time()))
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
    p = argparse.ArgumentParser(prog="python -m tools.bench.manyworkers", description=__doc__.split("\n\n")[0])
    p.add_argument("--chief", required=True, metavar="HOST:PORT")
    p.add_argument("--workers", type=int, required=True, metavar="K")
    p.add_argument("--prefix", default="w")
    p.add_argument("--first", type=int, default=0, metavar="R", help="the first worker's number")
    p.add_argument("--token", default=None)
    p.add_argument("--go", type=float, default=None, metavar="T", help="join at time.time() T")
    p.add_argument("--no-relay", action="store_true", help="relay to nobody (the chief streams to each)")
    p.add_argument("--deadline", type=float, default=600.0, metavar="S", help="give up after S seconds")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be at least 1")
    # Imports before the go time: a storm of joins, not of imports.
    import collective._api  # noqa: F401
    import collective.transport.grpc  # noqa: F401
    import collective.worker.agent  # noqa: F401

    ids = [f"{args.prefix}{i}" for i in range(args.first, args.first + args.workers)]
    out = run_workers(args.chief, ids, token=args.token, relay=not args.no_relay, go=args.go, deadline=args.deadline)
    print(json.dumps(out), flush=True)
    return 0 if out["started"] == args.workers and len(out["digests"]) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
