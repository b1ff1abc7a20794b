"""``collective launch``: the embedded default. Chief and N workers as local processes.

Starts the chief on a free loopback port, then the workers; shows every process's log lines
prefixed by role and rank and keeps each process's log in the run directory; prints a summary.
Guarantees: exit 0 only when start was released with every digest agreeing; no child process
is left behind, on failure, timeout or Ctrl-C (children are killed by process id). One launch
owns a run directory at a time (an flock, released when the launch ends or dies); each launch
clears the previous run's logs and summary first. The chief's port and summary files live in a
private directory, so a full run directory only cuts the logs short, never the round. The run
directory is checked and written as ``collective.cli.rundir`` says (no link followed, 0600 files);
while the chief runs, ``status.json`` there (0600) holds its address and token for
``collective status --run-dir``. A temporary run directory (no ``--run-dir``) is removed after a
successful run unless ``--keep-run-dir``; a failed or interrupted run's is kept and named.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from collective.chief.reports import failed_summary, shards_text
from collective.cli.rundir import RESULT_FILE, STATUS_FILE, RunDir
from collective.clusterenv import CLUSTER_VARS
from collective.config import Timeouts, timeouts_from_args
from collective.entry import early_sigint
from collective.errors import CollectiveError, DeadlineError, UsageError
from collective.model import available_memory
from collective.sizes import format_bytes
from collective.transport.registry import NETWORK, lookup


@dataclass
class Child:
    label: str
    proc: subprocess.Popen
    log_path: Path
    pumps: list[threading.Thread] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)   # both streams, as they came
    stdout: list[str] = field(default_factory=list)  # stdout only: where the JSON summary is
    open_streams: int = 2
    log_error: OSError | None = None  # why its log file stopped being written (a full disk)
    stopped: bool = False  # launch ended it (the round over, a deadline, Ctrl-C): no failure of its own

    def exit_text(self) -> str:
        code = self.proc.returncode
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit {code}"


# How long a worker's death may precede the chief's own verdict before launch stops waiting:
# a chief that aborts the round exits right after telling its workers. Also how long workers
# still running may take to end once the chief has exited with an error.
WORKER_LOSS_GRACE = 2.0
NO_SUMMARY = "the chief ended without a summary"
_LOG_LINE = re.compile(r"^\S+ (?:ERROR|CRITICAL) \S+ rank=\S* id=\S* phase=\S*: (.*)$")


class Launcher:
    def __init__(
        self,
        *,
        workers: int,
        devices_per_worker: int = 1,
        model: str = "mlp",
        seed: int | None = None,
        token: str | None = None,
        run_dir: str | None = None,
        timeouts: Timeouts | None = None,
        chunk_bytes: int | None = None,
        out: TextIO | None = None,
        quiet: bool = False,
        transport: str = NETWORK,
        shm: bool = True,
        topology: str = "auto",
        from_file: bool = False,
        shards=None,
        keep_run_dir: bool = False,
    ) -> None:
        self.shm = shm
        self.from_file = from_file
        self.shards = shards  # None, "dim0" or a mapping name -> placement (collective.shards)
        self.topology = topology
        self._transport = lookup(transport, "launch", what="--transport")  # one of the registry's
        self.transport = transport
        if workers < 1:
            raise UsageError(f"--workers must be at least 1, got {workers}")
        if devices_per_worker < 1:
            raise UsageError(f"--devices-per-worker must be at least 1, got {devices_per_worker}")
        _check_room(workers)
        self.workers = workers
        self.devices = ",".join(f"cpu:{i}" for i in range(devices_per_worker))
        self.model = model
        self.seed = seed
        self.token = token or secrets.token_hex(16)
        self.timeouts = timeouts or Timeouts()
        self.chunk_bytes = chunk_bytes
        self._dir = RunDir(run_dir or None)
        self.run_dir = self._dir.path
        self.keep_run_dir = keep_run_dir or not self._dir.temporary
        self.interrupted = False  # Ctrl-C: the children were asked to stop with SIGINT
        self._interrupted_result: dict | None = None  # the summary of a run Ctrl-C ended
        self.out = out or sys.stdout
        self.quiet = quiet
        self.children: list[Child] = []
        self._print_lock = threading.Lock()
        self._progress = None  # rich bars on a terminal, fed by the chief's Status RPC
        self._private: Path | None = None  # the chief's port and result files
        self._failure: str | None = None  # launch's own verdict (workers gone before the chief decided)
        self._failure_culprit: str | None = None  # the one worker that died, if one did
        self._cut: list[str] = []  # what could not be written to the run directory, and why
        self._result_file: Path | None = None  # the chief's summary, written once it has decided
        self._t0 = time.monotonic()
        self.warnings = self._idle_options(token is not None)  # said at start, and in the summary

    def _idle_options(self, token_given: bool) -> list[str]:
        """One line for each option given that does nothing in this run (not an error: the run
        is what it would be without it)."""
        from collective.sources import takes_seed

        out = []
        if self.seed is not None and not takes_seed(self.model):
            out.append(f"--seed {self.seed} does nothing: model {self.model} stores its values (only presets and "
                       f".yaml/.json specs draw theirs from a seed)")
        default = Timeouts()
        given = {  # each of registry.IDLE_OPTIONS: what was given, if it was
            "topology": self.topology != "auto" and f"--topology {self.topology} does",
            "no-shm": not self.shm and "--no-shm does",
            "token": token_given and "--token does",
            "heartbeats": (self.timeouts.heartbeat, self.timeouts.lease) != (default.heartbeat, default.lease)
            and "--heartbeat-interval / --heartbeat-timeout do",
        }
        for option, why in self._transport.idle.items():
            if given[option]:
                out.append(f"{given[option]} nothing under --transport {self.transport}: {why}")
        return out

    # --- processes ----------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        # A launch describes its own cluster: other launchers' conventions must not leak in.
        env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARS}
        env["COLLECTIVE_TOKEN"] = self.token  # not on the command line, where ps would show it
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _spawn(self, label: str, args: list[str], log_name: str, argv: list[str] | None = None) -> Child:
        log_path = self.run_dir / log_name
        # Started with SIGINT ignored (inherited through exec; Python keeps it until the entry
        # point takes SIGINT over): our Ctrl-C, passed on, never lands in a child's imports as a
        # KeyboardInterrupt traceback. One still loading ends at the SIGTERM that follows.
        ignoring = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignoring else None
        try:
            proc = subprocess.Popen(
                argv or [sys.executable, *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,  # apart from stdout, so the JSON line never interleaves with logs
                env=self._env(),
                text=True,
                bufsize=1,
                start_new_session=True,  # Ctrl-C reaches us; we stop the children ourselves
            )
        finally:
            if ignoring:
                signal.signal(signal.SIGINT, previous)
        child = Child(label, proc, log_path)
        try:
            log = self._dir.create(log_name)  # closed by the last pump to finish
        except OSError as exc:  # the stream is still drained and echoed
            log, child.log_error = None, exc
        lock = threading.Lock()
        for stream, is_stdout in ((proc.stdout, True), (proc.stderr, False)):
            t = threading.Thread(target=self._pump, args=(child, stream, is_stdout, log, lock), daemon=True)
            t.start()
            child.pumps.append(t)
        self.children.append(child)
        return child

    def _pump(self, child: Child, stream, is_stdout: bool, log, lock: threading.Lock) -> None:
        for line in stream:
            with lock:
                if child.log_error is None:
                    try:
                        log.write(line)
                        log.flush()
                    except OSError as exc:  # a full disk cuts the log; the stream is still drained
                        child.log_error = exc
                child.lines.append(line)
                if is_stdout:
                    child.stdout.append(line)
            # After Ctrl-C, what the processes say while stopping (mpiexec's banner) goes to the log only.
            if not self.quiet and not self.interrupted and not line.startswith('{"ok"'):
                self._echo(f"{child.label:<9}| {line.rstrip()}")
        with lock:
            child.open_streams -= 1
            if child.open_streams == 0 and log is not None:
                try:
                    log.close()
                except OSError as exc:
                    child.log_error = child.log_error or exc

    def _chief_grace(self) -> float:
        """How long a chief may take to end once told to (SIGTERM) or once it has decided: it
        fails the round at once and writes its summary, then lingers so workers hear it."""
        return self.timeouts.linger + self.timeouts.status_grace + 5.0

    def _stop_all(self, grace: float = 3.0) -> None:
        live = [c for c in self.children if c.proc.poll() is None]
        if self.interrupted:
            # Ctrl-C is passed on as what it was, so each process names SIGINT (and mpiexec's
            # job ends in one MPI_Abort(130) instead of a banner and exit 9: collective.mpi._end_job);
            # a process that has not taken SIGINT over yet (still loading) gets SIGTERM next.
            for c in live:
                c.stopped = True
                _signal(c.proc, signal.SIGINT)
            soon = time.monotonic() + 2.0
            for c in live:
                try:
                    c.proc.wait(max(0.0, soon - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            live = [c for c in live if c.proc.poll() is None]
        for c in live:
            c.stopped = True
            _signal(c.proc, signal.SIGTERM)
        start = time.monotonic()
        for c in live:
            # The chief gets the time to write its summary: SIGKILLed at 3 s, it once left none.
            chief = c is self.children[0] and self._transport.launch == "processes"  # not mpiexec
            limit = self._chief_grace() if chief else grace
            try:
                c.proc.wait(max(0.0, start + limit - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(c.proc, signal.SIGKILL)
                c.proc.wait(5)
        for c in self.children:
            for t in c.pumps:
                t.join(2)

    # --- the run --------------------------------------------------------------------------

    def run(self) -> dict:
        """Run one round. Returns the chief's summary (``ok`` says whether it succeeded).

        Raises ``UsageError`` when the run directory is unsafe or another live launch holds it,
        ``KeyboardInterrupt`` on Ctrl-C once every child has been stopped (``interrupted``; its
        summary, kept in the run directory too, is ``interrupted_summary()``)."""
        try:
            self._claim_run_dir()
        except BaseException:
            self._release_run_dir()
            if self._dir.temporary:
                self._dir.remove()
            raise
        self._t0 = time.monotonic()
        for warning in self.warnings:
            self._note(f"WARNING {warning}")
        ok = False
        previous = self._catch_interrupt()
        try:
            self._private = Path(tempfile.mkdtemp(prefix="collective-launch-"))
            result = self._run_mpi() if self._transport.launch == "mpiexec" else self._run_grpc()
            self._keep_result(result)
            ok = bool(result.get("ok"))
            if ok and not self.keep_run_dir:
                result["run_dir"] = None  # removed below: nothing of a good run is worth keeping
            return result
        except KeyboardInterrupt:  # the children are stopped (_run_grpc / _run_mpi): what they left
            self._keep_result(self.interrupted_summary())
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            if self._private is not None:
                shutil.rmtree(self._private, ignore_errors=True)
            self._dir.unlink(STATUS_FILE)  # the chief is gone: nothing to reach any more
            self._release_run_dir()
            if ok and not self.keep_run_dir:
                self._dir.remove()

    def _catch_interrupt(self):
        """On the main thread: the first Ctrl-C raises KeyboardInterrupt (the run unwinds and
        stops its children with SIGINT), a second one while they stop is not allowed to cut
        that short and leave processes behind. Returns the previous handler (None elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def on_sigint(signum, frame) -> None:
            if not self.interrupted:
                self.interrupted = True
                raise KeyboardInterrupt
            self._note("still stopping the processes of this run; they get SIGKILL after a few seconds")

        return signal.signal(signal.SIGINT, on_sigint)

    def interrupted_summary(self) -> dict:
        """The summary of a run Ctrl-C ended, with every key of any other (``--json`` prints one
        line for every ending): the chief's, naming SIGINT and the phase, when it left one, else
        launch's own; ``exit_code`` 130, as the command exits. A Ctrl-C after start was released
        (it cut only the chief's linger) leaves ``ok`` true, with a warning: the round happened."""
        if self._interrupted_result is None:
            result = self._result(self._result_file, spare_stopped=True)
            if result["ok"]:
                result["warnings"] = [*result["warnings"], "interrupted (SIGINT) after start was released: "
                                      "only the chief's linger was cut short"]
            elif not result.get("error") or result["error"] == NO_SUMMARY:
                result["error"] = "interrupted (SIGINT): every process of the run was stopped"
            result["exit_code"] = 130
            self._interrupted_result = result
        return self._interrupted_result

    def _claim_run_dir(self) -> None:
        """Take the run directory for this launch and clear the previous run's files from it."""
        self._dir.open()  # made 0700 as the default (mkdtemp) one, or checked: ours, no link
        fd = self._dir.open_lock()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise UsageError(
                f"run directory {self.run_dir} is in use by another launch (pid {holder}); "
                f"wait for it to end or pass another --run-dir"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # the pid is only for the message above; the flock is what protects the directory
        self._dir.clear()

    def _release_run_dir(self) -> None:
        self._dir.close()  # drops the flock; the lock file stays, so no one locks a stale inode

    def _keep_result(self, result: dict) -> None:
        """Copy the summary into the run directory; a full disk is noted, not fatal."""
        for c in self.children:
            if c.log_error is not None:
                self._cut.append(f"{c.log_path.name}: {c.log_error.strerror or c.log_error}")
        try:
            with self._dir.create(RESULT_FILE) as f:
                f.write(json.dumps(result))
        except OSError as exc:
            self._cut.append(f"result.json: {exc.strerror or exc}")
        if self._cut:
            result["logs_cut"] = "; ".join(self._cut)
            self._note(f"the run directory could not take everything, logs are cut short: {result['logs_cut']}")

    def _run_grpc(self) -> dict:
        assert self._private is not None
        port_file = self._private / "chief.port"
        result_file = self._result_file = self._private / "result.json"
        t = self.timeouts
        try:
            chief_args = [
                "-m", "collective.chief", "--workers", str(self.workers), "--model", self.model,
                "--bind", "127.0.0.1:0", "--port-file", str(port_file), "--result-file", str(result_file),
                "--join-timeout", str(t.join), "--ready-timeout", str(t.ready),
                "--shm" if self.shm else "--no-shm", "--topology", self.topology,
            ]
            if self.seed is not None:
                chief_args += ["--seed", str(self.seed)]
            if self.chunk_bytes:
                chief_args += ["--chunk-bytes", str(self.chunk_bytes)]
            if self.from_file:
                chief_args.append("--from-file")
            chief_args += self._shard_args()
            chief = self._spawn("chief", chief_args, "chief.log")
            port = self._wait_for_port(chief, port_file, t.join)
            # A chief that failed before serving (a bad model, --chunk-bytes, --shards) may be
            # gone by now: workers started then would only retry a closed port.
            if port is not None and chief.proc.poll() is None:
                self._write_status(port)
                self._start_progress(port)
                for i in range(self.workers):
                    self._spawn(
                        f"worker {i}",
                        [
                            "-m", "collective.worker", "--chief", f"127.0.0.1:{port}", "--worker-id", f"worker-{i}",
                            "--rank", str(i), "--devices", self.devices,
                            "--join-timeout", str(t.join), "--start-timeout", str(t.start),
                            "--shm" if self.shm else "--no-shm",
                        ],
                        f"worker-{i}.log",
                    )
            self._wait_all(deadline=time.monotonic() + t.join + t.ready + t.linger + 30)
        finally:
            self._stop_progress()
            self._stop_all()
        return self._result(result_file)

    def _run_mpi(self) -> dict:
        """``mpiexec -n N+1 python -m collective.mpi``; rank 0 prints the JSON summary."""
        mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
        if mpiexec is None:
            raise UsageError("mpiexec not found: install the mpi extra (pip install 'collective[mpi]') or a system MPI")
        t = self.timeouts
        args = [
            "-m", "collective.mpi", "--json", "--no-table", "--model", self.model, *(["--from-file"] if self.from_file else []),
            "--devices-per-worker", str(self.devices.count(",") + 1),
            "--join-timeout", str(t.join), "--ready-timeout", str(t.ready), "--start-timeout", str(t.start),
        ]
        if self.seed is not None:
            args += ["--seed", str(self.seed)]
        if self.chunk_bytes:
            args += ["--chunk-bytes", str(self.chunk_bytes)]
        assert self._private is not None
        result_file = self._result_file = self._private / "result.json"
        # Rank 0 writes it also when it aborts the job: the only way its cause and exit code get out.
        args += ["--result-file", str(result_file), *self._shard_args()]
        try:
            self._spawn("mpi", [], "mpiexec.log", argv=[mpiexec, "-n", str(self.workers + 1), sys.executable, *args])
            self._wait_all(deadline=time.monotonic() + t.join + t.ready + t.start + 30)
        finally:
            self._stop_all()
        return self._result(result_file)

    def _shard_args(self) -> list[str]:
        return [] if self.shards is None else ["--shards", shards_text(self.shards)]

    def _write_status(self, port: int) -> None:
        """Where ``collective status --run-dir`` finds this run's chief: its address and token,
        in a new 0600 file of the (private) run directory. Removed when the run ends."""
        try:
            with self._dir.create(STATUS_FILE) as f:
                f.write(json.dumps({"chief": f"127.0.0.1:{port}", "token": self.token, "launch_pid": os.getpid()}))
        except OSError as exc:
            self._cut.append(f"{STATUS_FILE}: {exc.strerror or exc}")
            return
        self._note(f"status: collective status --run-dir {self.run_dir}; logs: {self.run_dir}")

    def _wait_for_port(self, chief: Child, port_file: Path, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if port_file.exists():
                return int(port_file.read_text())
            if chief.proc.poll() is not None:
                return None
            time.sleep(0.02)
        raise DeadlineError(f"the chief did not start serving within {timeout:g} s; see {chief.log_path}")

    def _wait_all(self, deadline: float) -> None:
        chief_done_at = None
        lost_at = None
        while True:
            codes = [c.proc.poll() for c in self.children]
            if all(code is not None for code in codes):
                return
            now = time.monotonic()
            if codes[0] is not None and chief_done_at is None:
                chief_done_at = now
            # Once the chief has decided, workers have a few seconds to hear it and exit. A chief
            # that ended with an error has told whom it could (it lingers for them first): one
            # that failed before serving told no one, and a worker still retrying its closed
            # port would wait out its join timeout, so the rest are stopped after a short grace.
            after = self.timeouts.linger + 10 if codes[0] == 0 else WORKER_LOSS_GRACE
            if chief_done_at is not None and now - chief_done_at > after:
                if codes[0] != 0:
                    self._note(f"the chief ended ({self.children[0].exit_text()}); stopping "
                               f"{sum(c is None for c in codes)} worker(s) it can no longer tell")
                return
            # A worker that failed will not come back (launch restarts nothing): the round cannot
            # succeed, so the chief need not wait out its join timeout for it.
            lost = [c for c, code in zip(self.children[1:], codes[1:], strict=True) if code not in (None, 0)]
            if codes[0] is None and lost:
                lost_at = lost_at or now
                # A chief that has decided (its summary is written) is telling its workers:
                # it ends within its linger time, and stopping it early could only cut that short.
                decided = self._result_file is not None and self._result_file.exists()
                if decided and now - lost_at > WORKER_LOSS_GRACE + self._chief_grace():
                    return
                if not decided and now - lost_at > WORKER_LOSS_GRACE:
                    self._failure_culprit = lost[0].label.replace(" ", "-") if len(lost) == 1 else None
                    self._failure = "worker process(es) ended before the round did: " + "; ".join(
                        f"{c.label.replace(' ', '-')} (pid {c.proc.pid}, {c.exit_text()}"
                        + (f": {why}" if (why := _error_line(c.lines)) else "") + ")"
                        for c in lost
                    )
                    self._note(f"{self._failure}; stopping the chief")
                    return
            if now > deadline:
                self._note(f"launch deadline passed; stopping {sum(c is None for c in codes)} process(es)")
                return
            time.sleep(0.05)

    def _note(self, text: str) -> None:
        self._echo(f"{'launch':<9}| {text}")

    def _echo(self, line: str) -> None:
        with self._print_lock:
            if self._progress is not None:
                self._progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
            else:
                print(line, file=sys.stderr, flush=True)

    def _start_progress(self, port: int) -> None:
        if self.quiet or not sys.stderr.isatty():
            return  # plain log lines only; the chief logs progress periodically
        from collective.cli.status import BroadcastProgress

        self._progress_link = self._transport.load("link")(f"127.0.0.1:{port}", token=self.token)
        self._progress = BroadcastProgress(self._progress_link)
        self._progress.start()

    def _stop_progress(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress_link.close()
            self._progress = None

    def _result(self, result_file: Path | None, spare_stopped: bool = False) -> dict:
        """The chief's summary with launch's own keys; every key of ``SUMMARY_KEYS``, whatever
        happened (a chief that left no summary: its last error line, and what launch knows).
        ``spare_stopped``: what launch stopped is no failure even after a good round (Ctrl-C)."""
        codes = {c.label: c.proc.returncode for c in self.children}
        base = failed_summary(None, transport=self.transport, model=self.model)
        try:
            if result_file is None:  # stopped before the chief was started
                raise FileNotFoundError(NO_SUMMARY)
            result = {**base, **json.loads(result_file.read_text())}
        except (OSError, ValueError):
            chief_lines = self.children[0].lines if self.children else []
            result = {**base, "error": _error_line(chief_lines) or NO_SUMMARY}
        if self._failure and (not result.get("error") or "chief shutting down (SIGTERM)" in result["error"]):
            result["error"] = self._failure  # we stopped the chief; the lost workers are the reason
            result["culprit"] = self._failure_culprit
            # The chief's own phase when it was stopped: the plan out (a join time) means broadcast.
            result["error_phase"] = "broadcast" if (result.get("phases") or {}).get("join") is not None else "join"
        # After a failed round, what launch itself ended (workers still waiting to hear of it) did
        # not fail on its own: listing it would point at processes that are not at fault.
        spared = {c.label for c in self.children if c.stopped} if spare_stopped or not result.get("ok") else set()
        result["failed_processes"] = {label: code for label, code in codes.items() if code != 0 and label not in spared}
        if result["failed_processes"]:
            result["ok"] = False
        result["exit_code"] = exit_code(result)
        result["wall_seconds"] = round(time.monotonic() - self._t0, 3)
        result["run_dir"] = str(self.run_dir)
        result["warnings"] = [*self.warnings, *result.get("warnings", [])]
        chief = result.get("chief") or {}
        if self.from_file and chief and not chief.get("from_file"):
            result["warnings"] = [*result.get("warnings", []), "--from-file was ignored: the model has no "
                                  ".safetensors file to serve from (a preset, a spec or an .npz); it was read into memory"]
        return result


def _error_line(lines: list[str]) -> str | None:
    """The message of the last ERROR log line (without timestamp and context), else None."""
    for line in reversed(lines):
        m = _LOG_LINE.match(line.strip())
        if m:
            return m.group(1)
        if line.startswith("error: "):
            return line[len("error: "):].strip()
    return None


def exit_code(result: dict) -> int:
    """What ``collective launch`` exits with: 0 on success, the chief's 2 for bad input (its exit
    code, or under mpiexec the one its summary gives: the job ends in MPI_Abort), else 1."""
    if result.get("ok"):
        return 0
    return 2 if 2 in (result.get("failed_processes", {}).get("chief"), result.get("exit_code")) else 1


# What one local worker process takes before its model: the interpreter, numpy, gRPC and their
# threads (measured about 56 MiB; see BENCHMARKS.md, "Memory").
PROCESS_BYTES = 64 << 20


def _check_room(workers: int) -> None:
    """Refuse, before starting anything, more local processes than this host's memory holds:
    ``--workers 100000`` for 10 must not start processes until the machine swaps or the OOM
    killer comes. The model's own bytes are checked by the chief and each worker."""
    room = available_memory()
    need = (workers + 1) * PROCESS_BYTES
    if room is not None and need > room:
        raise UsageError(
            f"--workers {workers} would start {workers + 1:,} local processes of about "
            f"{format_bytes(PROCESS_BYTES)} each before the model ({format_bytes(need)}); this host has "
            f"{format_bytes(room)} available. Use fewer workers, or start workers on other hosts "
            f"(python -m collective.chief / python -m collective.worker)"
        )


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def command(args: argparse.Namespace) -> int:
    """``collective launch``: the run, then its summary table (and ``--json``'s line); exit 130 on Ctrl-C."""
    from collective.summary import summary_table

    launcher = None
    try:
        if early_sigint():  # a Ctrl-C while the command loaded
            raise KeyboardInterrupt
        launcher = Launcher(
            workers=args.workers,
            devices_per_worker=args.devices_per_worker,
            model=args.model,
            seed=args.seed,
            token=args.token,
            run_dir=args.run_dir,
            timeouts=timeouts_from_args(args),
            chunk_bytes=args.chunk_bytes,
            quiet=args.quiet,
            transport=args.transport,
            shm=args.shm,
            topology=args.topology,
            from_file=args.from_file,
            shards=args.shards,
            keep_run_dir=args.keep_run_dir,
        )
        result = launcher.run()
    except KeyboardInterrupt:
        if launcher is None:
            print("interrupted before the launch started: nothing was started", file=sys.stderr)
            if args.json:
                print(json.dumps(_not_started(args, "interrupted (SIGINT) before the launch started: nothing was "
                                                    "started", 130)))
            return 130
        where = launcher.run_dir
        print(f"interrupted: every process of the run was stopped; its logs are in {where} "
              f"(collective logs {where})", file=sys.stderr)
        if args.json:
            print(json.dumps(launcher.interrupted_summary()))
        return 130
    except CollectiveError as exc:  # refused before any process started (the run dir, the host's memory)
        if args.json:
            print(json.dumps(_not_started(args, exc, exc.exit_code)))
        raise
    print(summary_table(result, expected=args.workers), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return exit_code(result)


def _not_started(args: argparse.Namespace, error: object, code: int) -> dict:
    """``--json``'s summary line (every key of any other) of a launch that started nothing."""
    summary = failed_summary(error, transport=args.transport, model=args.model)
    summary["exit_code"] = code
    return summary
