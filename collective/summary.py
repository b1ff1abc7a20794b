"""The human summary of a round's result, as ``collective launch`` and ``collective.mpi`` print it:
``summary_table`` (what happened, the time on the chief's clock by phase, the rates, the digests,
one row per worker)."""

from __future__ import annotations

from collective.chief.reports import PHASES
from collective.model import VariableSpec
from collective.sizes import format_bytes


def model_bytes(result: dict) -> int:
    """The bytes of the round's variables (what "bytes in the model" counts): the summary's
    ``bytes`` is its arena's, which from a model's files (``--from-file``) holds their headers too."""
    variables = result.get("variables") or []
    if not variables:
        return int(result.get("bytes") or 0)
    return sum(VariableSpec(v["name"], tuple(v["shape"]), v["dtype"]).nbytes for v in variables)


def summary_table(result: dict, expected: int | None = None) -> str:
    """The human summary of a round, as ``collective launch`` prints it. ``expected``: the
    workers asked for (``--workers``); a failed round lists only those that joined."""
    workers = result.get("workers") or []
    ok = bool(result.get("ok"))
    nbytes = model_bytes(result)
    digests = {w["digest"] for w in workers}
    same_devices = len({len(w["devices"]) for w in workers}) <= 1
    if ok:
        agree = f"agree ({len(workers)}/{len(workers)} workers match the chief"
        agree += ", identical worker digests)" if same_devices and len(digests) == 1 and not result.get("shards") else ")"
    else:
        agree = "not verified"
    topology = f", topology {result['topology']}" if result.get("topology") else ""
    lines = [
        f"collective: {'broadcast complete, training started' if ok else 'FAILED'}",
        f"  transport   {result.get('transport', '-')}{topology}",
        f"  model       {result.get('model') or '-'}",
    ]
    if result.get("shards"):
        lines.append(f"  shards      {result['shards']} (each worker receives its own part, not a replica)")
    lines += [
        f"  workers     {len(workers)}" + (f" of {expected} joined" if expected is not None and len(workers) != expected
                                           else ""),
        f"  variables   {len(result.get('variables') or [])}",
        f"  bytes       {nbytes:,} ({format_bytes(nbytes)}) in the model"
        + (f"; workers received {', '.join(format_bytes(w.get('bytes', 0)) for w in workers)}"
           if result.get("shards") else ""),
        f"  time        {_phase_text(result)}",
    ]
    if result.get("wall_seconds") is not None:
        lines.append(f"  wall        {result['wall_seconds']:.3f} s (launch: processes started until they ended)")
    if ok:  # a failed round has no broadcast time worth showing
        lines.append(f"  seconds     {result.get('seconds') or 0.0:.3f}  (first byte sent until every worker ready: "
                     f"broadcast + verify)")
        lines += _rate_lines(workers, (result.get("phases") or {}).get("broadcast"))
    lines.append(f"  digests     {agree}")
    for warning in result.get("warnings") or []:
        lines.append(f"  WARNING     {warning}")
    if result.get("error"):
        lines.append(f"  error       {result['error']}")
        if result.get("culprit") or result.get("error_phase"):
            lines.append(f"  culprit     {result.get('culprit') or '-'} (phase {result.get('error_phase') or '-'})")
    if result.get("failed_processes"):
        lines.append("  exit codes  " + ", ".join(f"{k}={v}" for k, v in result["failed_processes"].items()))
    if result.get("run_dir"):
        lines.append(f"  logs        {result['run_dir']}  (collective logs {result['run_dir']})")
    elif result.get("wall_seconds") is not None:  # launch's own summary (collective.mpi has no run dir)
        lines.append("  logs        removed with the run's temporary directory (--keep-run-dir or --run-dir keeps them)")
    if result.get("logs_cut"):
        lines.append(f"  logs cut    {result['logs_cut']}")
    if workers:
        lines.append("")
        lines.append(f"  {'rank':<5} {'id':<14} {'devices':<16} {'replicas':>8} {'received':>11}  {'via':<6} digest")
        for w in workers:
            lines.append(
                f"  {w['rank']:<5} {w['id']:<14} {','.join(w['devices']):<16} {w['replicas']:>8} "
                f"{format_bytes(w.get('bytes', 0)):>11}  {w.get('via', '-'):<6} {w['digest'] or '-'}"
            )
    return "\n".join(lines)


def _phase_text(result: dict) -> str:
    """``total`` on the chief's clock and its phases back to back (``reports.phases``); - for a
    phase the round did not reach."""
    phases = result.get("phases") or {}
    secs = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    return f"{secs(phases.get('total'))} s on the chief: " + ", ".join(f"{n} {secs(phases.get(n))}" for n in PHASES)


def _rate_lines(workers: list[dict], broadcast: float | None) -> list[str]:
    """GiB/s over each worker's own bytes (its shard's, with shards) in the broadcast phase; a
    worker that mapped the chief's shared memory copied nothing over a network: no rate."""
    streamed = [w for w in workers if w.get("via") != "shm"]
    mapped = len(workers) - len(streamed)
    lines = []
    if streamed and broadcast:
        total = sum(w.get("bytes", 0) for w in streamed) / broadcast / 2**30
        lines.append(f"  GiB/s       {total / len(streamed):.3f} per worker, {total:.3f} aggregate (the bytes each "
                     f"worker received, over the broadcast phase; {len(streamed)} streamed)")
    if mapped:
        lines.append(f"  shm         {mapped} worker(s) mapped the chief's arena through shared memory "
                     f"(no bytes copied: no rate)")
    return lines
