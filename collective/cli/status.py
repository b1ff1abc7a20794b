"""The operator's view of a running chief: a status table, a live watch, a progress bar.

All of it reads the chief's Status RPC, so it works from any host that can reach the chief
(with the cluster token). ``status_text`` is plain text (logs, pipes, tests); ``watch`` and
``BroadcastProgress`` draw with rich when attached to a terminal.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import stat
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from collective._proto import collective_pb2 as pb
from collective.cli.rundir import LOCK_NAME, RESULT_FILE, STATUS_FILE
from collective.errors import UsageError
from collective.limits import MAX_ERROR_CHARS
from collective.logs import printable

# The most of an ended launch's result.json read (its variables are listed: a large model's is long).
RESULT_LIMIT = 256 << 20


@dataclass
class Run:
    """What a run directory says about its launch: the chief's ``address`` and ``token`` while
    it serves (from ``status.json``), or the ended launch's summary (``result``, from
    ``result.json``), and the launch's pid."""

    run_dir: str
    address: str | None = None
    token: str | None = None
    launch_pid: int | None = None
    result: dict | None = None


def _read_own(path: Path, limit: int) -> bytes | None:
    """The bytes of ``path`` if it is a regular file of this user (not followed through a link),
    None if it does not exist; anything else is refused in one line. One another user planted
    (root included) could point us, and a --token we pass, at an address of their choosing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    with open(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            raise UsageError(f"{path} is not a regular file of this user (uid {os.geteuid()}): not trusting the "
                             f"address and token in it")
        return f.read(limit)


def _launch_holds(run_dir: Path) -> bool:
    """Whether a live launch holds ``run_dir`` (its flock on the lock file)."""
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # the shared lock, if taken, goes with it
    return False


def ended_result(run_dir: str | Path) -> dict | None:
    """The summary an ended launch left in ``run_dir`` (``result.json``), None if none yet (or
    a half-written one)."""
    path = Path(run_dir) / RESULT_FILE
    raw = _read_own(path, RESULT_LIMIT)
    try:
        result = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    if not isinstance(result, dict):
        return None
    if not isinstance(result.get("workers") or [], list) or not isinstance(result.get("error") or "", str):
        raise UsageError(f"{path} is not a launch's summary (its workers a list, its error a string); "
                         f"its logs: collective logs {run_dir}")
    return result


def run_of(run_dir: str) -> Run:
    """What ``collective status --run-dir`` reaches: the running chief (``status.json``), else
    the ended launch's summary (``result.json``). UsageError in one line otherwise: no such
    directory, no launch, or a launch under MPI (no chief serves status there)."""
    path = Path(run_dir)
    raw = _read_own(path / STATUS_FILE, 64 << 10)
    if raw is not None:
        try:
            info = json.loads(raw)
            run = Run(run_dir, address=info["chief"], token=info.get("token"), launch_pid=info.get("launch_pid"))
            if not (isinstance(run.address, str) and isinstance(run.token, (str, type(None)))
                    and (run.launch_pid is None or type(run.launch_pid) is int and run.launch_pid > 0)):
                raise TypeError("not the types launch writes")
            return run
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"{path / STATUS_FILE} is not a launch's status file (JSON with chief and token)") from None
    if not path.is_dir():
        raise UsageError(f"run directory {run_dir} does not exist; pass the run dir a launch printed "
                         f"(status: collective status --run-dir DIR)")
    result = ended_result(path)
    if result is not None:
        return Run(run_dir, result=result)
    if (path / "mpiexec.log").exists() and _launch_holds(path):
        raise UsageError(f"the launch in {run_dir} runs under MPI (--transport mpi), where no chief serves status; "
                         f"follow it with collective logs {run_dir} (its outcome: {path / RESULT_FILE} once it ends)")
    raise UsageError(f"no running launch in {run_dir}: it has no {STATUS_FILE} (the launch has ended, or its chief "
                     f"has not started yet); its logs: collective logs {run_dir}")


def wait_for_outcome(run: Run, timeout: float = 300.0) -> dict | None:
    """The summary of the launch in ``run.run_dir`` once its chief is gone: launch writes
    ``result.json`` when its processes have ended (the chief's linger, the workers' exit), then
    removes ``status.json``. None when the directory is gone: launch removes only a successful
    run's temporary directory. DeadlineError after ``timeout`` s, or when the launch's process
    ended without a summary."""
    from collective.errors import DeadlineError

    path = Path(run.run_dir)
    deadline = time.monotonic() + timeout
    while True:
        result = ended_result(path)
        if result is not None:
            return result
        if not path.exists():
            return None
        if run.launch_pid is not None and not pid_alive(run.launch_pid) and ended_result(path) is None:
            raise DeadlineError(f"the chief of the launch in {run.run_dir} is gone and its launch (pid "
                                f"{run.launch_pid}) ended without a summary; its logs: collective logs {run.run_dir}")
        if time.monotonic() > deadline:
            raise DeadlineError(f"the chief of the launch in {run.run_dir} is gone and its launch wrote no summary "
                                f"within {timeout:g} s; its logs: collective logs {run.run_dir}")
        time.sleep(0.1)


def pid_alive(pid: int) -> bool:
    """Whether a process of that pid exists (another user's counts: not ours to judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process of that pid: alive, not ours to judge
    return True


def _outcome(result: dict) -> str:
    if result.get("ok"):
        workers = result.get("workers") or []
        return f"started: {len(workers)}/{len(workers)} workers verified, model {result.get('model') or '-'}"
    return f"failed: {printable(result.get('error') or 'see its logs', limit=MAX_ERROR_CHARS)}"


def outcome_text(run_dir: str, result: dict | None) -> str:
    """One line: how the launch in ``run_dir`` ended (``result``: its summary; None: its
    temporary directory is gone, which launch does only after a successful run)."""
    if result is None:
        return (f"the launch in {run_dir} has ended: started (it removed its temporary run dir, as it does only "
                f"after a successful run)")
    return f"the launch in {run_dir} has ended: {_outcome(result)}; summary: {Path(run_dir) / RESULT_FILE}"


def outcome_dict(run_dir: str, result: dict | None) -> dict:
    """``outcome_text`` as JSON: ``phase`` started or failed, as the Status RPC names them."""
    ok = result is None or bool(result.get("ok"))
    return {"ok": ok, "phase": "started" if ok else "failed", "ended": True, "run_dir": run_dir,
            "error": None if result is None else result.get("error"),
            "culprit": None if result is None else result.get("culprit"),
            "workers": None if result is None else len(result.get("workers") or []),
            "summary": None if result is None else str(Path(run_dir) / RESULT_FILE)}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def status_text(st: pb.StatusReply, address: str) -> str:
    """The status as a table of plain text lines."""
    lines = [
        f"chief {address} (incarnation {st.chief_incarnation or '-'}): {st.phase} for {st.seconds_in_phase:.1f} s; "
        f"{st.joined}/{st.expected} workers joined; model {st.model or '-'}"
    ]
    if st.waiting_for:
        lines.append(f"waiting for: {st.waiting_for}")
    if st.error:
        lines.append(f"error: {st.error}")
    if st.workers:
        lines.append(
            f"  {'rank':<5}{'worker':<18}{'host':<16}{'devices':<14}{'phase':<11}{'variables':>11}{'bytes':>24}{'heartbeat':>11}"
        )
        for w in st.workers:
            variables = f"{w.variables_received}/{w.variables_total}"
            nbytes = f"{_mib(w.bytes_received)}/{_mib(w.bytes_total)}"
            lines.append(
                f"  {w.rank:<5}{w.worker_id[:17]:<18}{w.host[:15]:<16}{','.join(w.devices)[:13]:<14}{w.phase:<11}"
                f"{variables:>11}{nbytes:>24}{w.seconds_since_heartbeat:>9.1f} s"
            )
    return "\n".join(lines)


def status_dict(st: pb.StatusReply) -> dict:
    """The status as plain JSON types: every field present, 64-bit counts as numbers.

    (protobuf's JSON mapping writes int64/uint64 as strings; byte counts are numbers here.)
    """
    from google.protobuf import json_format

    d = json_format.MessageToDict(st, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return _int64_as_int(st.DESCRIPTOR, d)


def _int64_as_int(desc, d: dict) -> dict:
    from google.protobuf.descriptor import FieldDescriptor

    wide = (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64)
    for f in desc.fields:
        v = d.get(f.name)
        if v is None:
            continue
        if f.message_type is not None:
            d[f.name] = [_int64_as_int(f.message_type, x) for x in v] if isinstance(v, list) else _int64_as_int(f.message_type, v)
        elif f.cpp_type in wide:
            d[f.name] = [int(x) for x in v] if isinstance(v, list) else int(v)
    return d


def watch(link, address: str, *, interval: float = 1.0, deadline: float | None = None, out=None) -> pb.StatusReply:
    """Redraw the status every ``interval`` s until the round has an outcome (or ``deadline``).

    Draws in place with rich on a terminal; prints a new block per change otherwise. Returns the
    last status. Raises what ``link.status`` raises (the chief unreachable, token refused).
    """
    out = out or sys.stdout
    if out.isatty():
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        with Live(console=Console(file=out), auto_refresh=False) as live:
            while True:
                st = link.status(timeout=5.0)
                live.update(Text(status_text(st, address)), refresh=True)
                if _over(st, deadline):
                    return st
                time.sleep(interval)
    last = None
    while True:
        st = link.status(timeout=5.0)
        text = status_text(st, address)
        if text.split("\n", 1)[-1] != (last or "").split("\n", 1)[-1] or _over(st, deadline):
            print(text + "\n", file=out, flush=True)
            last = text
        if _over(st, deadline):
            return st
        time.sleep(interval)


def _over(st: pb.StatusReply, deadline: float | None) -> bool:
    return st.phase in ("started", "failed") or (deadline is not None and time.monotonic() > deadline)


class BroadcastProgress:
    """A rich progress bar per worker (bytes, rate, ETA), fed from the chief's Status RPC.

    Used by ``collective launch`` on a terminal. ``console`` is where other lines must be printed
    while the bars are shown. ``stop`` is idempotent and never raises.
    """

    def __init__(self, link, interval: float = 0.2) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.console = Console(file=sys.stderr)
        self._link = link
        self._interval = interval
        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
            TransferSpeedColumn(), TimeRemainingColumn(), console=self.console, transient=False,
        )
        self._tasks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def start(self) -> None:
        self._progress.start()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                st = self._link.status(timeout=2.0)
            except Exception:  # noqa: BLE001 - the chief may be starting or gone; the bars just pause
                continue
            for w in st.workers:
                key = w.worker_id
                if key not in self._tasks:
                    self._tasks[key] = self._progress.add_task(f"rank {w.rank} {key}", total=w.bytes_total or None)
                self._progress.update(self._tasks[key], completed=w.bytes_received, total=w.bytes_total or None)
            if st.phase in ("started", "failed"):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._progress.stop()


def command(args: argparse.Namespace) -> int:
    """``collective status``: the chief's answer, or with ``--run-dir`` an ended launch's outcome."""
    from collective.config import parse_address
    from collective.errors import ChiefUnreachableError
    from collective.transport.grpc import GrpcChiefLink

    run = None
    if args.run_dir:
        if args.chief:
            raise UsageError("pass either --run-dir or --chief, not both")
        run = run_of(args.run_dir)
        if run.address is None:  # the launch has ended: its summary says how
            return _ended(args, run.run_dir, run.result)
        args.chief = run.address
        args.token = args.token or run.token
    if not args.chief:
        from collective.clusterenv import from_environment

        env = from_environment(os.environ)
        args.chief = env.chief_address if env else None
    if not args.chief:
        raise UsageError("pass --chief HOST:PORT (or set COLLECTIVE_CHIEF), or --run-dir DIR of a running launch")
    parse_address(args.chief, what="--chief")
    link = GrpcChiefLink(args.chief, token=args.token)
    try:
        if args.watch and not args.json:
            st = watch(link, args.chief, interval=args.interval)
        else:
            st = link.status(timeout=5.0)
    except ChiefUnreachableError:
        if run is None:
            raise
        # A launch's chief ends soon after the outcome (it answers Status for a moment more):
        # launch then writes the summary into the run dir.
        return _ended(args, run.run_dir, wait_for_outcome(run))
    finally:
        link.close()
    if args.json:
        print(json.dumps(status_dict(st)))
    elif not args.watch:
        print(status_text(st, args.chief))
    return 1 if st.phase == "failed" else 0


def _ended(args: argparse.Namespace, run_dir: str, result: dict | None) -> int:
    """``collective status --run-dir`` of a launch whose chief is gone: its outcome, exit 0 when started."""
    shown = outcome_dict(run_dir, result)
    print(json.dumps(shown) if args.json else outcome_text(run_dir, result))
    return 0 if shown["ok"] else 1
