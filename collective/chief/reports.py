"""What the chief tells about a round: the Status RPC's answer (``collective status``) and the
summary of a finished round (``collective launch --json``, ``--result-file``). Read-only views
of a ``ChiefService``, taken under its lock."""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import os
import resource
import secrets
import time
from pathlib import Path

from collective._proto import collective_pb2 as pb
from collective.chief.members import Phase
from collective.digest import worker_digest

log = logging.getLogger("collective.chief")


def write_result(path: Path, result: dict) -> None:
    """Write the summary whole (a reader never sees half of it; a new file of a random name,
    O_EXCL, renamed over ``path``: no name another user could plant a link at); a full disk
    loses the file, never the round's outcome or exit code."""
    tmp: Path | None = None
    try:
        name = path.parent / f".{path.name}.{secrets.token_hex(6)}"
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)  # the umask applies, as before
        tmp = name  # ours to remove if what follows fails
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(result))
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        log.warning("could not write the round's summary to %s: %s; the outcome stands (%s)",
                    path, exc.strerror or exc, "started" if result.get("ok") else "failed")
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def write_outcome(svc) -> None:
    """The summary, the moment the round's outcome is decided and before the chief lingers for
    its workers and watchers: a launcher that stops the chief soon after still has it."""
    if svc.result_file is not None:
        write_result(svc.result_file, summary(svc))


def peak_rss_bytes() -> int:
    """This process's peak resident set: ``VmHWM`` of /proc/self/status, the high-water mark of
    its own memory. Not ``getrusage``'s ``ru_maxrss`` (the fallback elsewhere): Linux carries that
    over from the process that forked this one, so a 70 MiB chief started by a 1.4 GiB pytest
    process reported 1.4 GiB."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def status_reply(svc) -> pb.StatusReply:
    """Who has joined, each worker's phase and progress, and whom the chief waits for."""
    with svc._cond:
        now = time.monotonic()
        return pb.StatusReply(
            phase=svc._phase.value,
            expected=svc.num_workers,
            joined=len(svc._members),
            chief_incarnation=svc.incarnation,
            seconds_in_phase=now - svc._phase_at,
            model=svc.source.description,
            waiting_for="" if svc._phase in (Phase.STARTED, Phase.FAILED) else svc._supervisor.waiting_for(),
            workers=[_worker_status(svc, m, now) for m in sorted(svc._members.values(), key=lambda m: m.rank)],
            error=str(svc._error or ""),
        )


def _worker_status(svc, m, now: float) -> pb.WorkerStatus:
    """One worker's line: its progress through the bytes it receives (with shards, its own)."""
    plan = svc.plan_of(m) if svc._plan is not None else None
    ends = sorted(v.offset + v.nbytes for v in plan.variables) if plan is not None else []
    return pb.WorkerStatus(
        rank=m.rank, worker_id=m.worker_id, host=m.host, devices=m.devices,
        phase=m.phase, bytes_received=m.received(), bytes_total=svc.bytes_total(m),
        variables_received=bisect.bisect_right(ends, m.received()),
        variables_total=len(plan.variables) if plan is not None else len(svc.specs),
        seconds_since_heartbeat=now - m.last_seen,
    )


def summary(svc) -> dict:
    """The summary of a round, as ``collective launch --json`` prints it."""
    with svc._cond:
        plan = svc._plan
        members = sorted(svc._members.values(), key=lambda m: m.rank)
        return {
            "ok": svc._phase is Phase.STARTED,
            "transport": svc.transport,
            "seconds": round(svc.broadcast_seconds(), 6),
            "bytes": int(svc.arena.nbytes),
            "model": svc.source.description,
            "error": str(svc._error) if svc._error else None,
            # Who the chief blames and in which phase, when it blames one party (errors.CollectiveError).
            "culprit": svc._error.culprit if svc._error else None,
            "error_phase": svc._error.phase if svc._error else None,
            "workers": [
                {
                    "rank": m.rank,
                    "id": m.worker_id,
                    "host": m.host,
                    "devices": list(m.devices),
                    "replicas": [n for s in _held(svc, m, plan) for n in m.replica_names(s.name)],
                    "digest": m.worker_digest,
                    # What the chief requires of its ready report: the plan's digests on every device.
                    "expected_digest": _expected_digest(svc.plan_of(m), len(m.devices)) if plan is not None else "",
                    "incarnation": m.incarnation,
                    "pid": m.pid,
                    # With shards: which one it holds and its bytes (collective.shards).
                    **({"shard": svc.plan_of(m).shard.index, "bytes": svc.bytes_total(m)}
                       if svc.sharded and plan is not None else {}),
                }
                for m in members
            ],
            # The chief's side of the clock and its memory: loading the model (read and hashed), from
            # then until every worker was ready, and its peak resident set (file pages it had
            # mapped count while mapped; ``--from-file`` drops them once hashed and once sent).
            "chief": {
                "from_file": svc._arena.file is not None,
                "load_seconds": round(svc.materialize_seconds, 6),
                "ready_seconds": round(svc._ready_at - svc._created_at, 6) if svc._ready_at is not None else None,
                "peak_rss_bytes": peak_rss_bytes(),
            },
            "rejoined": list(svc._rejoins.rejoined),  # worker ids that came back mid-broadcast
            "variables": [
                {
                    "name": v.name,
                    "shape": list(v.shape),
                    "dtype": v.dtype,
                    "group_key": v.group_key,
                    "instance_key": v.instance_key,
                    "digest": v.digest,
                }
                for v in (plan.variables if plan is not None else [])
            ],
            **({"chief_replicas": {"devices": list(svc._local.devices), "digest": svc._local.worker_digest}}
               if svc._local is not None else {}),
        }


def _held(svc, m, plan) -> list:
    """The variables ``m`` holds (with shards, its pieces: a partition may leave some out)."""
    return list(svc.plan_of(m).variables) if svc.sharded and plan is not None else svc.specs


def _expected_digest(plan: pb.Plan, devices: int) -> str:
    return worker_digest(plan.manifest_digest, [list(plan.chunk_digests)] * devices)
