"""What the chief tells about a round: the Status RPC's answer (``collective status``) and the
summary of a finished round (``collective launch --json``, ``--result-file``). Read-only views
of a ``ChiefService`` and its round's state (``chief/state.py``), taken under its lock."""

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
from collective.chief.state import RoundState
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


def write_outcome(svc, state: RoundState) -> None:
    """The summary, the moment the round's outcome is decided and before the chief lingers for
    its workers and watchers: a launcher that stops the chief soon after still has it."""
    if svc.result_file is not None:
        write_result(svc.result_file, summary(svc, state))


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


def status_reply(svc, state: RoundState, brief: bool = False) -> pb.StatusReply:
    """Who has joined, each worker's phase and progress (not with ``brief``), and whom the chief
    waits for."""
    with state.cond:
        now = time.monotonic()
        ends: dict = {}  # per plan (one, or each shard's): where each variable ends
        return pb.StatusReply(
            phase=state.phase.value,
            expected=svc.num_workers,
            joined=len(state.members),
            chief_incarnation=svc.incarnation,
            seconds_in_phase=now - state.phase_at,
            model=svc.source.description,
            waiting_for="" if state.phase in (Phase.STARTED, Phase.FAILED) else svc.supervisor.waiting_for(),
            workers=[] if brief else [_worker_status(svc, state, m, now, ends)
                                      for m in sorted(state.members.values(), key=lambda m: m.rank)],
            error=str(state.error or ""),
        )


def _worker_status(svc, state: RoundState, m, now: float, ends_of: dict) -> pb.WorkerStatus:
    """One worker's line: its progress through the bytes it receives (with shards, its own).
    ``ends_of``: the variables' ends per plan, sorted once for all workers that share it (sorted
    for each worker: 3 ms for 20,000 variables, 3.3 s a Status at 1,024 workers, under the lock)."""
    plan = svc.plan_of(m) if state.plan is not None else None
    ends: list[int] = []
    if plan is not None:
        if id(plan) not in ends_of:  # the plan is held there too, so its id is not reused meanwhile
            ends_of[id(plan)] = (plan, sorted(v.offset + v.nbytes for v in plan.variables))
        ends = ends_of[id(plan)][1]
    return pb.WorkerStatus(
        rank=m.rank, worker_id=m.worker_id, host=m.host, devices=m.devices,
        phase=m.phase, bytes_received=m.received(), bytes_total=svc.bytes_total(m),
        variables_received=bisect.bisect_right(ends, m.received()),
        variables_total=len(plan.variables) if plan is not None else len(svc.specs),
        seconds_since_heartbeat=now - m.last_seen,
    )


def summary(svc, state: RoundState) -> dict:
    """The summary of a round, as ``collective launch --json`` prints it: the keys of
    ``SUMMARY_KEYS``, on success and on failure alike (``failed_summary``)."""
    with state.cond:
        plan = state.plan
        members = sorted(state.members.values(), key=lambda m: m.rank)
        error = state.error
        ok = state.phase is Phase.STARTED
        return {
            **failed_summary(error, transport=svc.transport, model=svc.source.description),
            "ok": ok,
            "exit_code": 0 if ok else (error.exit_code if error is not None else 1),
            "seconds": round(svc.broadcast_seconds(), 6),
            "bytes": int(svc.arena.nbytes),
            "topology": plan.topology if plan is not None else None,
            "shards": shards_text(svc.shard_request) if svc.sharded else None,
            "phases": phases(state),
            "workers": [
                {
                    "rank": m.rank,
                    "id": m.worker_id,
                    "host": m.host,
                    "devices": list(m.devices),
                    # A count, as launch always gave: the names follow from the variables and devices.
                    "replicas": sum(len(m.devices) for _ in _held(svc, m, plan)),
                    "digest": m.worker_digest,
                    # What the chief requires of its ready report: the plan's digests on every device.
                    "expected_digest": _expected_digest(svc.plan_of(m), len(m.devices)) if plan is not None else "",
                    "incarnation": m.incarnation,
                    "pid": m.pid,
                    # The bytes it received (with shards, its shard's), which index, and how: a
                    # worker that mapped the chief's shared memory moved no bytes over a network.
                    "bytes": svc.bytes_total(m) if plan is not None else 0,
                    "shard": svc.plan_of(m).shard.index if svc.sharded and plan is not None else None,
                    "via": "shm" if m.mapped else "stream",
                }
                for m in members
            ],
            # The chief's side of the clock and its memory: loading the model (read and hashed), from
            # then until every worker was ready, and its peak resident set (file pages it had
            # mapped count while mapped; ``--from-file`` drops them once hashed and once sent).
            "chief": {
                "from_file": svc.from_file,
                "load_seconds": round(svc.materialize_seconds, 6),
                "ready_seconds": round(state.ready_at - state.created_at, 6) if state.ready_at is not None else None,
                "peak_rss_bytes": peak_rss_bytes(),
            },
            "rejoined": list(svc.rejoins.rejoined),  # worker ids that came back mid-broadcast
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
            "chief_replicas": ({"devices": list(state.local.devices), "digest": state.local.worker_digest}
                               if state.local is not None else None),
        }


PHASES = ("load", "join", "prepare", "broadcast", "verify")


def phases(state: RoundState) -> dict:
    """The round's phases on the chief's clock, back to back, so they add up to ``total``:
    load (the model read or mapped, before serving), join (until every worker is in and the
    plan is out), prepare (workers check the plan and prepare their arenas, until the first
    byte), broadcast (until the last byte reached the last worker), verify (until every worker
    reported its replicas verified). A phase the round never reached is None; ``total`` runs
    to the outcome (start released, or the failure)."""
    marks = state.marks
    end = state.ready_at if state.ready_at is not None else (state.phase_at if state.phase is Phase.FAILED else None)
    bounds = [state.created_at, state.started_at, marks.get("plan"), state.first_byte_at, marks.get("sent"),
              state.ready_at]
    out = {name: (round(b - a, 6) if a is not None and b is not None else None)
           for name, a, b in zip(PHASES, bounds, bounds[1:], strict=False)}
    out["total"] = round((end if end is not None else time.monotonic()) - state.created_at, 6)
    return out


# Every key of a round's summary, success or failure, wherever it is printed (launch, the
# chief's --result-file, collective.mpi --json); launch fills the last five (the chief gives them null or empty).
SUMMARY_KEYS = ("ok", "exit_code", "transport", "model", "error", "culprit", "error_phase", "seconds", "bytes",
                "topology", "shards", "phases", "workers", "chief", "rejoined", "variables", "chief_replicas",
                "wall_seconds", "run_dir", "failed_processes", "logs_cut", "warnings")


def failed_summary(error, *, transport: str, model: str | None, phase: str | None = None,
                   culprit: str | None = None) -> dict:
    """A summary with every key of ``summary``: of a round that failed before its chief had a
    service (the model would not load), or the base ``summary`` fills in. ``phase`` and
    ``culprit``: what to say when ``error`` names neither."""
    return {
        "ok": False,
        "exit_code": getattr(error, "exit_code", 1) if error is not None else 1,
        "transport": transport,
        "model": model,
        "error": str(error) if error is not None else None,
        # Who the chief blames and in which phase, when it blames one party (errors.CollectiveError).
        "culprit": (getattr(error, "culprit", None) or culprit) if error is not None else None,
        "error_phase": (getattr(error, "phase", None) or phase) if error is not None else None,
        "seconds": None, "bytes": 0, "topology": None, "shards": None,
        "phases": dict.fromkeys((*PHASES, "total")),
        "workers": [], "chief": None, "rejoined": [], "variables": [], "chief_replicas": None,
        "wall_seconds": None, "run_dir": None, "failed_processes": {}, "logs_cut": None, "warnings": [],
    }


def shards_text(request) -> str:
    """The shard request as ``--shards`` takes it: dim0, or the JSON object; an HSDP mesh's
    (``shards.Groups``: one request over S shards, each held by several training ranks) says
    which shard each training rank holds too."""
    groups = getattr(request, "shard_of", None)
    if groups is not None:
        return f"{shards_text(request.request)} over {max(groups) + 1 if groups else 0} shards (training rank -> shard: " \
               f"{','.join(map(str, groups))})"
    return request if isinstance(request, str) else json.dumps(request, sort_keys=True)


def _held(svc, m, plan) -> list:
    """The variables ``m`` holds (with shards, its pieces: a partition may leave some out)."""
    return list(svc.plan_of(m).variables) if svc.sharded and plan is not None else svc.specs


def _expected_digest(plan: pb.Plan, devices: int) -> str:
    return worker_digest(plan.manifest_digest, [list(plan.chunk_digests)] * devices)
