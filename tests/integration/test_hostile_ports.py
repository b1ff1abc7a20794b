"""Strangers on the chief's ports while a round runs: real chief and worker processes on loopback.

A port scanner, a slow-loris or a confused client may open thousands of connections and say
nothing. They must not take the chief's file descriptors (1,024 is the usual soft limit), stop
its accept loops, or flood its log; the workers' round completes beside them.
"""

from __future__ import annotations

import json
import resource
import socket
import time

import grpc
import pytest

from collective.transport.grpc import DATA_PATH, TOKEN_HEADER
from collective.transport.rawtcp import PENDING_MAX
from tests.procs import file_limit

pytestmark = pytest.mark.integration

TOKEN = "hostile-ports-token"
IDLE = 2000
LIMIT = 1024  # the usual soft limit on open files
ROUND = ["--join-timeout", "60", "--no-shm"]  # the network path, with the ports under attack


@pytest.fixture
def descriptors():
    """Enough descriptors in this process for IDLE client sockets (the hard limit allowing)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < IDLE + 512:
        pytest.skip(f"needs a hard limit of {IDLE + 512} open files for its {IDLE} client sockets; this one is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, IDLE + 512), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class Idle:
    """Connections that open and never send a byte."""

    def __init__(self) -> None:
        self.socks: list[socket.socket] = []

    def open(self, n: int, family: int, address) -> None:
        for _ in range(n):
            s = socket.socket(family, socket.SOCK_STREAM)
            self.socks.append(s)
            s.settimeout(30)  # a connect the server never takes fails the test instead of hanging it
            deadline = time.monotonic() + 30
            while True:
                try:
                    s.connect(address)
                    break
                except BlockingIOError:  # a unix socket's full backlog: wait for the server to accept
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)

    def close(self) -> None:
        for s in self.socks:
            s.close()


def data_path(address: str) -> tuple[int, str]:
    """The chief's raw data port and abstract unix socket name, asked as a worker asks."""
    with grpc.insecure_channel(address) as channel:
        answer = channel.unary_unary(DATA_PATH)(b"", metadata=((TOKEN_HEADER, TOKEN),), timeout=30).decode()
    port, _, unix_name = answer.partition(" ")
    return int(port), unix_name


def run_round(cluster, chief, n: int = 3) -> None:
    workers = [cluster.worker(f"w{i}", *ROUND, env={"COLLECTIVE_TOKEN": TOKEN}) for i in range(n)]
    for w in workers:
        assert w.wait(120) == 0, w.output()
    assert chief.wait(60) == 0, chief.output()
    result = json.loads((cluster.tmp / "result.json").read_text())
    assert result["ok"] is True and len({w["digest"] for w in result["workers"]}) == 1, result


def test_a_round_completes_while_2000_idle_connections_sit_on_the_raw_data_port(cluster, descriptors):
    # Hard limit 1,024 too, so the chief cannot lift it: the data server itself must bound what
    # strangers hold. Before, it accepted each one into a thread until EMFILE, whereupon its
    # accept loop returned for good and the gRPC port could take no worker either.
    chief = cluster.chief("--workers", "3", *ROUND, env={"COLLECTIVE_TOKEN": TOKEN}, wrapper=file_limit(LIMIT, LIMIT))
    port, unix_name = data_path(cluster.address)
    idle = Idle()
    try:
        idle.open(IDLE // 2, socket.AF_INET, ("127.0.0.1", port))
        idle.open(IDLE // 2, socket.AF_UNIX, "\0" + unix_name)
        run_round(cluster, chief)
    finally:
        idle.close()
    log = chief.output()
    # Cut, oldest first, beyond PENDING_MAX, and summarised per host rather than logged one by one.
    assert f"more than {PENDING_MAX} connections had not said who they are" in log
    assert log.count("data connection") < 100, log.count("data connection")


def test_a_round_completes_while_2000_idle_connections_sit_on_the_grpc_port(cluster, descriptors):
    # Soft limit 1,024 under a higher hard one, as most systems start a process: the chief
    # lifts its soft limit (entry.raise_fd_limit) and gRPC holds every idle connection until
    # its handshake timeout.
    chief = cluster.chief("--workers", "3", *ROUND, env={"COLLECTIVE_TOKEN": TOKEN},
                          wrapper=file_limit(LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    host, _, port = cluster.address.rpartition(":")
    idle = Idle()
    try:
        idle.open(IDLE, socket.AF_INET, (host, int(port)))
        run_round(cluster, chief)
    finally:
        idle.close()


def test_a_cli_process_lifts_its_soft_file_limit_to_the_hard_one(cluster):
    hard = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1 << 20)
    if hard <= LIMIT:
        pytest.skip(f"the hard limit on open files is {hard}: nothing to lift")
    chief = cluster.chief("--workers", "1", "--join-timeout", "30", wrapper=file_limit(LIMIT, hard))
    with open(f"/proc/{chief.pid}/limits") as f:
        line = next(ln for ln in f if ln.startswith("Max open files"))
    assert line.split()[3:5] == [str(hard), str(hard)], line
