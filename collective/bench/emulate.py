"""Emulated hosts on one machine: network namespaces on a private bridge (needs root).

``Topology`` builds a throwaway network: a *switch* namespace holding a bridge, and one namespace
per host (``chief``, ``worker-1`` ...) joined to it by a veth pair, each host with its own address
in ``10.77.0.0/24``. Every ``ip`` command names one of these namespaces (``ip -n``), so the
machine's own network is never touched. Each host is a long-lived *holder* process started by
``ip netns exec`` (which bind-mounts ``/etc/netns/<ns>/hosts`` over ``/etc/hosts``, so host names
resolve) inside ``unshare -m -u``: its own host name and a private tmpfs on ``/dev/shm``, so no
same-host shortcut bypasses the emulated network. Commands enter a host with
``nsenter -t <holder> -n -m -u``. ``Topology.shape`` limits a host's link both ways with ``tc tbf``.

Used by ``collective bench --emulate-hosts`` and by the multihost tests (``tests/multihost``, which
add the docker-compose file on top).

Cleanup: ``Topology`` is a context manager; ``close`` (run on exit, also on an error) kills what
it started by pid, then deletes its namespaces (their veths and bridge go with them) and its
``/etc/netns/<ns>`` directories. If the owning process itself is killed, its host processes get
SIGKILL (parent-death signal), the holders exit when their stdin pipe closes, and the next
``Topology`` deletes the namespaces a process that no longer exists left behind (names carry the
owner's pid).
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Protocol

from collective.cli.status import pid_alive

# The directory holding the collective package (a checkout's root, with its chief and worker
# shims, or site-packages): processes on emulated hosts import it from here (PYTHONPATH), as the
# machine's own processes do.
ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.77.0"  # only ever assigned inside namespaces this module creates
NETNS_RUN = Path("/run/netns")
ETC_NETNS = Path("/etc/netns")
_PREFIX = "mh"
_NAME = re.compile(rf"^{_PREFIX}(\d+)x\d+-")
_serial = count()


class ServiceLike(Protocol):
    """What ``Topology.run_service`` needs of a service (the tests' compose ``Service``)."""

    name: str
    command: list[str]
    environment: dict[str, str]


class HostProcessError(AssertionError):
    """A process on an emulated host did not do what was awaited (exited early, timed out).

    An AssertionError, so a test that uses the harness fails as an assertion with the output."""


def local_argv(argv: Sequence[str]) -> list[str]:
    """``python`` (as a container image would name it) becomes this interpreter."""
    argv = list(argv)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


# --- can namespaces be made here; stale ones ---------------------------------------------------


def _run(*args: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def unavailable_reason(what: str = "emulated hosts", *, root_hint: str = "") -> str | None:
    """Why network namespaces cannot be made here, or None when they can. ``what`` names the
    user in the message ("multihost tests"); ``root_hint`` is appended to the need-root line."""
    tools = ("ip", "unshare", "nsenter", "setpriv", "mount")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        return f"{what} need {', '.join(missing)} (iproute2, util-linux) on PATH"
    probe = f"{_PREFIX}{os.getpid()}x{next(_serial)}-probe"
    try:
        made = _run("ip", "netns", "add", probe, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run `ip netns add`: {exc}"
    if made.returncode != 0:
        return (
            f"cannot create a network namespace (`ip netns add` failed: {made.stderr.strip()}); "
            f"{what} need root{root_hint}"
        )
    _run("ip", "netns", "del", probe, check=False)
    return None


def sweep_stale() -> list[str]:
    """Delete namespaces (and /etc/netns dirs) this module made in a process that is gone."""
    removed = []
    names = {p.name for d in (NETNS_RUN, ETC_NETNS) if d.is_dir() for p in d.iterdir()}
    for name in sorted(names):
        m = _NAME.match(name)
        if m and not pid_alive(int(m.group(1))):
            if (NETNS_RUN / name).exists():
                _run("ip", "netns", "del", name, check=False)
            shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
            removed.append(name)
    return removed


# --- processes -------------------------------------------------------------------------------


class Process:
    """A process on an emulated host; stdout and stderr go to ``log``. Killed by pid only."""

    def __init__(self, host: str, name: str, argv: list[str], env: dict[str, str], log: Path, cwd: Path) -> None:
        self.host, self.name, self.argv, self.log = host, name, argv, log
        self.started = time.monotonic()
        self._fh = open(log, "w")
        self.popen = subprocess.Popen(
            argv, stdout=self._fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
            start_new_session=True,
        )
        self.pid = self.popen.pid
        self.ended: float | None = None

    @property
    def returncode(self) -> int | None:
        rc = self.popen.poll()
        if rc is not None and self.ended is None:
            self.ended = time.monotonic()
        return rc

    def wait(self, timeout: float) -> int:
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise HostProcessError(
                f"{self.name} on {self.host} still running after {timeout:g} s:\n{self.output()}"
            ) from None
        self.returncode  # noqa: B018 - records the end time
        return rc

    def output(self) -> str:
        self._fh.flush()
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """Block until ``pattern`` (a regex) appears in the output; fail if the process ends first."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            m = rx.search(self.output())
            if m:
                return m
            if self.returncode is not None:
                raise HostProcessError(
                    f"{self.name} on {self.host} exited {self.returncode} before logging "
                    f"{pattern!r}:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                raise HostProcessError(f"{self.name} on {self.host} did not log {pattern!r} within {timeout:g} s:\n{self.output()}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.popen.wait(10)
        self._fh.close()


def wait_all(procs: Sequence[Process], timeout: float) -> dict[str, int]:
    """Block until every process has exited (each one's ``ended`` is then exact to ~50 ms);
    return their exit codes by name. Fails naming the ones still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        running = [p for p in procs if p.returncode is None]
        if not running:
            return {p.name: p.popen.returncode for p in procs}
        if time.monotonic() > deadline:
            raise HostProcessError(
                f"still running after {timeout:g} s: {', '.join(p.name for p in running)}\n"
                + "\n".join(f"--- {p.name}\n{p.output()}" for p in procs)
            )
        time.sleep(0.05)


# --- the topology ----------------------------------------------------------------------------------


@dataclass
class Host:
    name: str
    ns: str  # the `ip netns` name
    address: str
    link: str  # the veth end in the switch namespace; down = the host's cable is cut
    holder: subprocess.Popen | None = None


_HOLDER = (
    'hostname "$1" && mount -t tmpfs -o size=256m,mode=1777 shm /dev/shm && echo ready && read _'
)


class Topology:
    """Hosts on one bridge, each in its own network, mount and UTS namespace.

    ``with Topology(["chief", "worker-1"], tmp_path) as net:`` builds it (blocking, a second or
    so); ``net.run_service(service, "chief")`` starts a compose service on a host;
    ``net.cut("worker-1")`` pulls a host's cable. Everything is removed on exit.
    """

    def __init__(self, hosts: Sequence[str], workdir: Path, *, subnet: str = SUBNET) -> None:
        if len(set(hosts)) != len(hosts) or not hosts:
            raise ValueError(f"host names must be unique and non-empty: {hosts}")
        if len(hosts) > 250:
            raise ValueError("at most 250 hosts fit the /24 test subnet")
        for h in hosts:
            if not re.fullmatch(r"[a-z][a-z0-9-]{0,12}", h):
                raise ValueError(f"host name {h!r}: lowercase letters, digits and '-', at most 13 characters")
        self.workdir = Path(workdir)
        self.tag = f"{_PREFIX}{os.getpid()}x{next(_serial)}"
        self.switch = f"{self.tag}-sw"
        self.hosts = {
            h: Host(h, f"{self.tag}-{h}", f"{subnet}.{i + 2}", f"v-{h}") for i, h in enumerate(hosts)
        }
        self.procs: list[Process] = []
        self._namespaces: list[str] = []
        self._etc_netns_made = False

    # -- building ---------------------------------------------------------------------------

    def __enter__(self) -> Topology:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ns_add(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)

    def _build(self) -> None:
        sweep_stale()
        self.workdir.mkdir(parents=True, exist_ok=True)
        sw = self.switch
        self._ns_add(sw)
        _run("ip", "-n", sw, "link", "set", "lo", "up")
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n" + "".join(
            f"{h.address}\t{h.name}\n" for h in self.hosts.values()
        )
        self._etc_netns_made = not ETC_NETNS.exists()
        for h in self.hosts.values():
            self._ns_add(h.ns)
            _run("ip", "-n", sw, "link", "add", h.link, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            _run("ip", "-n", sw, "link", "set", h.link, "master", "br0", "up")
            _run("ip", "-n", h.ns, "link", "set", "lo", "up")
            _run("ip", "-n", h.ns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            _run("ip", "-n", h.ns, "link", "set", "eth0", "up")
            etc = ETC_NETNS / h.ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            # No name server in this network: every name comes from the hosts file.
            (etc / "resolv.conf").write_text("nameserver 127.0.0.1\n")
        for h in self.hosts.values():
            h.holder = subprocess.Popen(
                ["ip", "netns", "exec", h.ns, "unshare", "-m", "-u", "--propagation", "private", "--",
                 "sh", "-c", _HOLDER, "holder", h.name],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            )
        for h in self.hosts.values():
            self._await_holder(h)

    def _await_holder(self, h: Host, timeout: float = 10.0) -> None:
        assert h.holder is not None and h.holder.stdout is not None
        ready, _, _ = select.select([h.holder.stdout], [], [], timeout)
        line = h.holder.stdout.readline().decode(errors="replace").strip() if ready else ""
        if line != "ready":
            rest = h.holder.stdout.read1(4096).decode(errors="replace") if ready else ""
            raise RuntimeError(f"host {h.name}: its namespace holder did not start ({line} {rest})".strip())
        # `ip netns exec` and `unshare` exec, so the holder's pid is in the host's namespace.
        want = os.stat(NETNS_RUN / h.ns).st_ino
        got = os.readlink(f"/proc/{h.holder.pid}/ns/net")
        if got != f"net:[{want}]":
            raise RuntimeError(f"host {h.name}: holder pid {h.holder.pid} is in {got}, not the namespace {h.ns}")

    # -- using it -------------------------------------------------------------------------------

    def enter(self, host: str) -> list[str]:
        """The argv prefix that runs a command on ``host``.

        ``setpriv --pdeathsig KILL`` ends the command with the test process, even a killed one.
        nsenter (without --pid) and setpriv exec, so the pid stays the command's own.
        """
        holder = self.hosts[host].holder
        assert holder is not None
        return ["nsenter", "-t", str(holder.pid), "-n", "-m", "-u", "--", "setpriv", "--pdeathsig", "KILL", "--"]

    def base_env(self, host: str) -> dict[str, str]:
        """What a container's process would have, less the image: no COLLECTIVE_* from the test."""
        return {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": str(self.workdir),
            "LANG": "C.UTF-8",
            "HOSTNAME": host,
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }

    def run(self, host: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None, name: str | None = None) -> Process:
        """Start ``argv`` on ``host`` (not blocking); its output goes to ``<workdir>/<name>.log``."""
        name = name or host
        full_env = self.base_env(host) | dict(env or {})
        p = Process(host, name, self.enter(host) + local_argv(argv), full_env, self.workdir / f"{name}.log", self.workdir)
        self.procs.append(p)
        return p

    def run_service(self, service: ServiceLike, host: str, *, extra_env: Mapping[str, str] | None = None, name: str | None = None) -> Process:
        """Start a compose service on ``host``: its command, with its environment (then ``extra_env``)."""
        if not service.command:
            raise ValueError(f"service {service.name} has no command in the compose file")
        return self.run(host, service.command, env=service.environment | dict(extra_env or {}), name=name)

    def exec(self, host: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 20.0) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` to the end (blocking, within ``timeout``)."""
        return subprocess.run(
            self.enter(host) + local_argv(argv), capture_output=True, text=True, timeout=timeout,
            env=self.base_env(host) | dict(env or {}), cwd=self.workdir, stdin=subprocess.DEVNULL,
        )

    def write_rsh(self, path: Path) -> Path:
        """Write an ``rsh``-like launcher: ``PATH HOST COMMAND...`` runs COMMAND (one shell line,
        as rsh/ssh would) on emulated ``HOST``. MPICH's ``mpiexec -launcher rsh -launcher-exec
        PATH -hosts chief,worker-1`` starts its proxies on the emulated hosts with it."""
        cases = "".join(
            f"  {shlex.quote(h.name)}) set -- {' '.join(map(shlex.quote, self.enter(h.name)))} ;;\n"
            for h in self.hosts.values()
        )
        path = Path(path)
        path.write_text(
            "#!/bin/sh\n"
            "# rsh for the emulated hosts of one Topology: HOST COMMAND...\n"
            'host="$1"; shift\n'
            'for a in "$@"; do case "$a" in -*) shift ;; *) break ;; esac; done  # rsh/ssh options\n'
            'line="$*"\n'
            'case "$host" in\n'
            f"{cases}"
            '  *) echo "no emulated host $host" >&2; exit 255 ;;\n'
            "esac\n"
            'exec "$@" sh -c "$line"\n'
        )
        path.chmod(0o755)
        return path

    def cut(self, host: str) -> None:
        """Pull ``host``'s cable: its link on the switch goes down; nothing reaches it any more."""
        _run("ip", "-n", self.switch, "link", "set", self.hosts[host].link, "down")

    def shape(self, host: str, rate: str, *, queue: str = "100ms", burst: str = "256kb") -> None:
        """Limit ``host``'s link to ``rate`` (e.g. ``20mbit``) both ways with tbf: on the host's
        side for its uplink, on the switch's side for its downlink (netem is not available).
        ``queue`` is how long a packet may wait in the link's queue: a link kept full by a bulk
        flow delays every other packet on it by about that much (a long, busy path's RTT).
        ``burst``: the token bucket, what an idle link lets through at once (above the kernel's
        64 KiB segments, or tbf drops them)."""
        h = self.hosts[host]
        for ns, dev in ((h.ns, "eth0"), (self.switch, h.link)):
            _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                 "latency", queue)

    def heal(self, host: str) -> None:
        _run("ip", "-n", self.switch, "link", "set", self.hosts[host].link, "up")

    def link_bytes(self, host: str) -> dict[str, int]:
        """Bytes received and sent on ``host``'s own interface (eth0): ``{"rx": …, "tx": …}``."""
        info = json.loads(_run("ip", "-n", self.hosts[host].ns, "-j", "-s", "link", "show", "eth0").stdout)[0]
        stats = info.get("stats64") or info["stats"]
        return {"rx": int(stats["rx"]["bytes"]), "tx": int(stats["tx"]["bytes"])}

    # -- cleanup ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill what was started (by pid), then remove namespaces, links and files. Idempotent."""
        problems = []
        for p in self.procs:
            try:
                p.kill()
            except Exception as exc:  # noqa: BLE001 - keep cleaning up; report at the end
                problems.append(f"{p.name} (pid {p.pid}): {exc}")
        for h in self.hosts.values():
            if h.holder is not None:
                if h.holder.poll() is None:
                    os.kill(h.holder.pid, signal.SIGKILL)
                h.holder.wait(10)
                for f in (h.holder.stdin, h.holder.stdout):
                    if f is not None:
                        f.close()
                h.holder = None
        for ns in reversed(self._namespaces):
            done = _run("ip", "netns", "del", ns, check=False)
            if done.returncode != 0 and (NETNS_RUN / ns).exists():
                problems.append(f"ip netns del {ns}: {done.stderr.strip()}")
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        self._namespaces.clear()
        if self._etc_netns_made:
            try:
                ETC_NETNS.rmdir()  # only if empty: another run may be using it
            except OSError:
                pass
        if problems:
            raise RuntimeError("emulated network cleanup incomplete: " + "; ".join(problems))

    def leftovers(self) -> list[str]:
        """Namespaces or /etc/netns dirs of this topology that still exist (empty after close)."""
        names = [self.switch] + [h.ns for h in self.hosts.values()]
        return [str(d / n) for n in names for d in (NETNS_RUN, ETC_NETNS) if (d / n).exists()]
