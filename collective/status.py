"""The operator's view of a running chief: a status table, a live watch, a progress bar.

All of it reads the chief's Status RPC, so it works from any host that can reach the chief
(with the cluster token). ``status_text`` is plain text (logs, pipes, tests); ``watch`` and
``BroadcastProgress`` draw with rich when attached to a terminal.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
import time
from pathlib import Path

from collective._proto import collective_pb2 as pb
from collective.errors import UsageError
from collective.rundir import STATUS_FILE


def chief_of_run(run_dir: str) -> tuple[str, str | None]:
    """The (address, token) of the chief of the launch running in ``run_dir``, from its 0600
    ``status.json``; a missing, linked or foreign file is refused in one line."""
    path = Path(run_dir) / STATUS_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UsageError(f"no running launch in {run_dir}: it has no {STATUS_FILE} (the launch has ended, or its chief "
                         f"has not started yet); its logs: collective logs {run_dir}") from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    with open(fd, "rb") as f:
        st = os.fstat(f.fileno())
        # Only our own file: one another user planted (root included) could point us, and a
        # --token we pass, at an address of their choosing.
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            raise UsageError(f"{path} is not a regular file of this user (uid {os.geteuid()}): not trusting the "
                             f"address and token in it")
        raw = f.read(64 << 10)
    try:
        info = json.loads(raw)
        return str(info["chief"]), info.get("token")
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"{path} is not a launch's status file (JSON with chief and token)") from None


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
