"""``collective bench --from-file``: a checkpoint served from its files against the copy.

Writes (or takes, ``--checkpoint DIR``) a sharded safetensors checkpoint of ``--size`` bytes in
``--files`` files, then runs ``collective launch --workers N --model DIR --json`` for each row,
``--repeat`` times, interleaved:

* ``copy``: the chief reads the files into its arena (a memfd with shared memory), as without
  the flag;
* ``from-file``: ``--from-file``, the chief maps the files read-only and sends them;

each with launch's default shared memory (same-host workers map the chief's arena, or the files)
and, with ``--no-shm``, over loopback instead. Per row (median of the runs): ``read`` = the
chief's load (read and hash every byte; the chief's ``load_seconds``), ``broadcast`` = first byte
sent until every worker is ready (``seconds``), ``to ready`` = from the chief's loading the model
to every worker ready (``ready_seconds``: read, the workers' join and arena setup, broadcast),
``ratio`` = to ready / max(read, broadcast), and the chief's peak resident set (``VmHWM``;
file pages count while the chief maps them). ``--drop-caches`` (root) drops the page cache before
every run, so ``read`` is a cold read of the files; otherwise the first run warms them.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from collective.bench.checkpoint import write_checkpoint
from collective.bench.runners import _clean_env, _last_json, _run_job, _tail, _timeout
from collective.bench.spec import _positive, parse_workers
from collective.errors import UsageError
from collective.sizes import format_bytes, parse_size

ROWS = {"copy": [], "from-file": ["--from-file"]}
FIELDS = ("load_seconds", "seconds", "ready_seconds", "peak_rss_bytes")


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def one_run(model: Path, workers: int, extra: list[str], run_dir: Path, size: int) -> dict:
    argv = [sys.executable, "-m", "collective.cli", "launch", "--workers", str(workers), "--model", str(model),
            "--json", "--quiet", "--run-dir", str(run_dir), *extra]
    run_dir.mkdir(parents=True, mode=0o700)  # launch refuses a run dir others may write (umask 002)
    rc, out = _run_job(argv, timeout=_timeout(size, workers, 1e9), env=_clean_env(), log=run_dir / "bench.log")
    result = _last_json(out, "ok")
    if rc != 0 or not result or not result.get("ok"):
        raise UsageError(f"{' '.join(extra) or 'copy'} failed (exit {rc}): {(result or {}).get('error') or _tail(out)}; "
                         f"logs in {run_dir}")
    shutil.rmtree(run_dir, ignore_errors=True)
    chief = result["chief"]
    return {"load_seconds": chief["load_seconds"], "seconds": result["seconds"],
            "ready_seconds": chief["ready_seconds"], "peak_rss_bytes": chief["peak_rss_bytes"]}


def run_from_file(args, say: Callable[[str], None]) -> int:
    size = parse_size(args.size)
    counts = parse_workers(args.workers or ["3"])
    if len(counts) != 1:
        raise UsageError(f"--from-file runs one worker count, not {counts}")
    workers, repeat, shards = counts[0], _positive(args.repeat, "--repeat"), _positive(args.files, "--files")
    if args.drop_caches and os.geteuid() != 0:
        raise UsageError("--drop-caches needs root (it writes /proc/sys/vm/drop_caches)")
    shm = ["--no-shm"] if args.no_shm else []
    work = Path(tempfile.mkdtemp(prefix="collective-bench-ff-"))
    try:
        model = Path(args.checkpoint) if args.checkpoint else None
        if model is None:
            say(f"writing a {format_bytes(size)} checkpoint in {shards} shard(s)")
            model = write_checkpoint(work / "ckpt", size, shards).parent
        samples: dict[str, list[dict]] = {name: [] for name in ROWS}
        for i in range(repeat):
            for name, flags in ROWS.items():
                if args.drop_caches:
                    drop_caches()
                got = one_run(model, workers, [*flags, *shm], work / f"run-{i}-{name}", size)
                say(f"{name} run {i + 1}: " + ", ".join(f"{k} {v}" for k, v in got.items()))
                samples[name].append(got)
        rows = {name: {k: statistics.median(s[k] for s in runs) for k in FIELDS} for name, runs in samples.items()}
        for r in rows.values():
            r["peak_rss_bytes"] = int(r["peak_rss_bytes"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    caches = "cold (dropped before every run)" if args.drop_caches else "warm after the first run"
    lines = [f"{format_bytes(size)} checkpoint, {shards} shard(s), {workers} local worker(s), "
             f"{'loopback' if args.no_shm else 'shared memory'}, page cache {caches}; median of {repeat}",
             f"{'row':<10} {'read s':>8} {'broadcast s':>12} {'to ready s':>11} {'ratio':>6} {'chief peak RSS':>15}"]
    for name, r in rows.items():
        ratio = r["ready_seconds"] / max(r["load_seconds"], r["seconds"])
        lines.append(f"{name:<10} {r['load_seconds']:>8.2f} {r['seconds']:>12.2f} {r['ready_seconds']:>11.2f} "
                     f"{ratio:>6.2f} {format_bytes(int(r['peak_rss_bytes'])):>15}")
    print("\n".join(lines), file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps({"from_file": rows, "bytes": size, "workers": workers, "shards": shards,
                          "cold": bool(args.drop_caches), "shm": not args.no_shm}), flush=True)
    return 0
