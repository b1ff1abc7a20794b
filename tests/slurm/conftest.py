"""A real single-host Slurm cluster for the tests in this package, started once per session.

The ``slurm`` fixture starts munged, slurmctld and slurmd in the foreground (``-D``) as child
processes of the test run, each by pid, with a config of their own in a temporary directory
(``SLURM_CONF``; the host's /etc/slurm is never read): this host as controller and only node,
``CPUs=8`` (``SlurmdParameters=config_overrides``: 4 tasks fit on 2 real cores), free ports,
munge authentication over the fixture's own socket and key, no cgroups
(``proctrack/linuxproc``, ``task/none``), no accounting (``scontrol show job`` is the record;
finished jobs stay there for ``MinJobAge``), ``KillWait=30`` and ``JobRequeue=1``. It waits,
with a deadline, until ``sinfo`` shows the node idle; at the end it cancels what still runs,
stops the daemons by pid and removes the directory.

Slurm comes from ``scripts/install-slurm.sh`` (Debian's slurm-wlm 22.05 and munge). Without it
the tests skip saying so, unless ``COLLECTIVE_REQUIRE_FRAMEWORKS=1`` or ``CI=true``, which make that a failure.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.procs import ROOT

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("srun", "sbatch", "sinfo", "squeue", "scontrol", "scancel")
KILL_WAIT = 30  # slurm.conf KillWait: seconds between a step's SIGTERM and its SIGKILL
START_DEADLINE = 30.0
# Job states after which a job runs no more (squeue's long names).
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE"}


def _missing() -> str | None:
    """Why this host cannot run the cluster, or None."""
    absent = [c for c in (*DAEMONS, *COMMANDS) if shutil.which(c) is None]
    if absent:
        return f"Slurm is not installed (no {', '.join(absent)}): run scripts/install-slurm.sh as root"
    if os.geteuid() != 0:
        return "slurmd must run as root to start job steps (scripts/install-slurm.sh installs Slurm as root)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _first_job_id(count: int = 40) -> int:
    """A first job id whose next ``count`` jobs map to free chief ports: collective's rule under
    Slurm is port 20000 + SLURM_JOB_ID % 10000, and this host runs other engineers' servers."""
    for _ in range(50):
        first = random.randrange(1000, 9000)
        if all(_port_free(20000 + (first + i) % 10000) for i in range(count)):
            return first
    return random.randrange(1000, 9000)


@dataclass
class SlurmCluster:
    """The running cluster: its directory, this host's name and the environment every Slurm
    command (and every job) needs: ``SLURM_CONF``, the venv's ``python`` first on ``PATH``."""

    tmp: Path
    host: str
    env: dict[str, str]
    kill_wait: int = KILL_WAIT
    started_seconds: float = 0.0
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)

    def run(self, *args: str, timeout: float = 30.0, env: dict[str, str] | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm command (or a job launched by one), its output captured, with a deadline."""
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**self.env, **(env or {})}, stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
        return proc

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict of its KEY=VALUE fields ({} once it is forgotten)."""
        proc = self.run("scontrol", "show", "job", "-o", job_id, check=False, timeout=15)
        if proc.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))

    def state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "UNKNOWN")

    def wait_state(self, job_id: str, states: set[str], timeout: float) -> str:
        """Poll until the job is in one of ``states``; its state, or AssertionError at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state(job_id)
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {state} after {timeout:g} s (waited for {sorted(states)}):\n"
                                     f"{self.job(job_id)}\n{self.log_tail()}")
            time.sleep(0.1)

    def wait_finished(self, job_id: str, timeout: float) -> str:
        return self.wait_state(job_id, FINISHED, timeout)

    def task_pids(self, step: str) -> dict[int, int]:
        """Global task id (rank) -> pid of each task of ``step`` (``JOB.STEP``), from
        ``scontrol listpids``, which asks the slurmd that started them."""
        out = self.run("scontrol", "listpids", step, check=False, timeout=15).stdout
        pids: dict[int, int] = {}
        for line in out.splitlines()[1:]:
            cols = line.split()
            if len(cols) >= 5 and cols[0].isdigit() and cols[4].isdigit():
                pids[int(cols[4])] = int(cols[0])
        return pids

    def sbatch(self, script: str, *args: str, output: Path, env: dict[str, str] | None = None) -> str:
        """Submit ``script`` (a path under the checkout) with its output to ``output``; the job id."""
        proc = self.run("sbatch", "--parsable", f"--output={output}", script, *args, env=env)
        return proc.stdout.strip().split(";")[0]

    def log_tail(self, lines: int = 15) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.tmp / name
            if path.exists():
                out.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    def cancel_all(self, timeout: float = 20.0) -> None:
        """Cancel every job of this cluster and wait, with a deadline, until none is left."""
        jobs = self.run("squeue", "-h", "-o", "%i", check=False, timeout=15).stdout.split()
        if jobs:
            self.run("scancel", *jobs, check=False, timeout=15)
        deadline = time.monotonic() + timeout
        while self.run("squeue", "-h", "-o", "%i", check=False, timeout=15).stdout.split():
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)


def _config(tmp: Path, host: str, munge_socket: Path) -> str:
    ports = (_free_port(), _free_port())
    return f"""\
# Written by tests/slurm/conftest.py for one test session; nothing outside this directory.
ClusterName=collective-test
SlurmctldHost={host}
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits this long before it runs again (default 120 s).
AuthInfo=socket={munge_socket},cred_expire=10
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
# No cgroups: processes tracked through /proc, tasks not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# 8 CPUs on whatever the host has (2 cores here): slurmd takes the configured counts.
SlurmdParameters=config_overrides
ReturnToService=2
FirstJobId={_first_job_id()}
KillWait={KILL_WAIT}
JobRequeue=1
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=60
NodeName={host} CPUs=8 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _start(name: str, args: list[str], tmp: Path, env: dict[str, str]) -> subprocess.Popen:
    log = open(tmp / f"{name}.out", "w")
    try:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=tmp, start_new_session=True)
    finally:
        log.close()


def _stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def _wait_idle(cluster: SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        for name, proc in cluster.daemons.items():
            if proc.poll() is not None:
                out = (cluster.tmp / f"{name}.out").read_text(errors="replace")
                raise AssertionError(f"{name} exited {proc.returncode} at start:\n{out}\n{cluster.log_tail()}")
        proc = cluster.run("sinfo", "-h", "-n", cluster.host, "-o", "%T", check=False, timeout=10)
        state = proc.stdout.strip()
        if state == "idle":
            return
        time.sleep(0.1)
    raise AssertionError(f"node {cluster.host} not idle within {timeout:g} s (sinfo: {state!r})\n{cluster.log_tail()}")


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A running single-host Slurm cluster (``SlurmCluster``); stopped and removed at the end."""
    why = _missing()
    if why:
        if os.environ.get("COLLECTIVE_REQUIRE_FRAMEWORKS") == "1" or os.environ.get("CI") == "true":
            pytest.fail(f"Slurm is required here (COLLECTIVE_REQUIRE_FRAMEWORKS=1 or CI=true): {why}")
        pytest.skip(why)
    t0 = time.monotonic()
    tmp = tmp_path_factory.mktemp("slurm")
    (tmp / "state").mkdir()
    (tmp / "spool").mkdir()
    # munged's socket path must fit a sockaddr_un (108 bytes); a deep --basetemp gets a short one.
    sock_dir = tmp / "munge"
    if len(str(sock_dir / "munge.socket")) > 100:
        sock_dir = Path(tempfile.mkdtemp(prefix="munge-"))
    else:
        sock_dir.mkdir()
    munge_socket = sock_dir / "munge.socket"
    key = tmp / "munge.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(1024))
    host = socket.gethostname().split(".")[0]
    conf = tmp / "slurm.conf"
    conf.write_text(_config(tmp, host, munge_socket))

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "COLLECTIVE_", "SBATCH_", "SRUN_"))}
    for name in ("TF_CONFIG", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    env["SLURM_CONF"] = str(conf)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "/usr/bin:/bin")])
    env["PYTHONUNBUFFERED"] = "1"
    cluster = SlurmCluster(tmp=tmp, host=host, env=env)
    try:
        # --force: munged refuses a socket directory under pytest's 0700 base directory otherwise.
        cluster.daemons["munged"] = _start("munged", [
            "munged", "--foreground", "--force", f"--socket={munge_socket}", f"--key-file={key}",
            f"--pid-file={tmp}/munged.pid", f"--log-file={tmp}/munged.log", f"--seed-file={tmp}/munged.seed",
        ], tmp, env)
        deadline = time.monotonic() + 10
        while not munge_socket.exists():
            if cluster.daemons["munged"].poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"munged did not start:\n{(tmp / 'munged.out').read_text()}")
            time.sleep(0.05)
        cluster.daemons["slurmctld"] = _start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(conf)], tmp, env)
        cluster.daemons["slurmd"] = _start("slurmd", ["slurmd", "-D", "-f", str(conf)], tmp, env)
        _wait_idle(cluster, START_DEADLINE)
        cluster.started_seconds = time.monotonic() - t0
        yield cluster
    finally:
        if "slurmctld" in cluster.daemons and cluster.daemons["slurmctld"].poll() is None:
            try:
                cluster.cancel_all()
            except (subprocess.TimeoutExpired, OSError):
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            if name in cluster.daemons:
                _stop(cluster.daemons[name])
        if sock_dir != tmp / "munge":
            shutil.rmtree(sock_dir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
