"""The same-host fast path: the chief's arena as a sealed memfd, mapped copy-on-write."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from tests.procs import ROOT, socket_inodes, wait_until

pytestmark = pytest.mark.integration



def launch(tmp_path, *args):
    proc = subprocess.run(
        [sys.executable, "-m", "collective.cli", "launch", "--json", "--quiet", "--run-dir", str(tmp_path / "run"),
         *args], capture_output=True, text=True, timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL,
    )
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.parametrize("shm, via", [("--shm", "shared memory"), ("--no-shm", "the network")])
def test_workers_on_the_chiefs_host_get_bit_exact_replicas_either_way(tmp_path, shm, via):
    arrays = {"w": np.random.default_rng(3).standard_normal((300, 70)).astype(np.float32),
              "ids": np.arange(11, dtype=">i8"), "flag": np.array(True)}
    path = tmp_path / "m.npz"
    np.savez(path, **arrays)
    code, result, err = launch(tmp_path, "--workers", "3", "--devices-per-worker", "2", "--model", str(path), shm)
    assert code == 0, err
    want = {k: xxhash.xxh3_128_hexdigest(np.ascontiguousarray(a).tobytes()) for k, a in arrays.items()}
    assert {v["name"]: v["digest"] for v in result["variables"]} == want
    for w in result["workers"]:
        assert w["replicas"] == 6  # 3 variables on 2 devices
    for i in range(3):
        log = (tmp_path / "run" / f"worker-{i}.log").read_text()
        assert f"through {via}" in log, log


def test_replicas_mapped_from_shared_memory_are_private_to_each_worker(tmp_path, cluster):
    """A worker that writes its replica 0 changes neither the chief's arena nor another worker's."""
    script = tmp_path / "writer.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from collective import join as join_cluster\n"
        "r = join_cluster(sys.argv[1], worker_id=sys.argv[2], devices='cpu:0,cpu:1')\n"
        "v = r.variables.get('dense_1/kernel')\n"
        "before = float(v.replicas[1][0, 0])\n"
        "if sys.argv[2] == 'writer':\n"
        "    v.replicas[0][...] = 42.0\n"
        "print('replica0', float(v.replicas[0][0, 0]), 'replica1', before, flush=True)\n"
    )
    from tests.procs import Proc

    cluster.chief("--workers", "2", "--join-timeout", "30")
    writer = Proc([str(script), cluster.address, "writer"], tmp_path / "writer.log")
    reader = Proc([str(script), cluster.address, "reader"], tmp_path / "reader.log")
    cluster.procs += [writer, reader]
    assert writer.wait(60) == 0, writer.output()
    assert reader.wait(60) == 0, reader.output()
    assert "replica0 42.0" in writer.output()
    reader_value = float(reader.output().split("replica0 ")[1].split()[0])
    writer_replica1 = float(writer.output().split("replica1 ")[1].split()[0])
    assert reader_value != 42.0 and reader_value == writer_replica1


def _memfds(pid: int) -> list[str]:
    """The memfds process ``pid`` holds open or mapped, by name."""
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    with open(f"/proc/{pid}/maps") as fh:
        held += [line.split(None, 5)[5].strip() for line in fh if len(line.split(None, 5)) > 5]
    return [h for h in held if h.startswith("/memfd:")]


def test_the_arena_is_a_memfd_gone_from_a_worker_once_it_drops_its_variables(tmp_path, cluster):
    """Nothing in /dev/shm to leak: the arena is a memfd, freed when its last holder lets go.
    The chief holds it while serving; a worker maps it (its replicas) until it drops them."""
    script = tmp_path / "holder.py"
    script.write_text(
        "import gc, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from collective import join as join_cluster\n"
        "r = join_cluster(sys.argv[1], worker_id=sys.argv[2])\n"
        "print('JOINED', flush=True)\n"
        "sys.stdin.readline()\n"
        "del r\n"
        "gc.collect()\n"
        "print('DROPPED', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    chief = cluster.chief("--workers", "1", "--join-timeout", "30")
    # The port file comes once the chief listens, before its model (and arena) is loaded.
    wait_until(lambda: any(m.startswith("/memfd:collective-arena") for m in _memfds(chief.pid)), "the chief's memfd")
    holder = subprocess.Popen([sys.executable, str(script), cluster.address, "w0"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "JOINED"
        held = _memfds(holder.pid)
        assert any(m.startswith("/memfd:collective-arena") for m in held), held  # came through shared memory
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "DROPPED"
        assert _memfds(holder.pid) == []  # no descriptor, no mapping: nothing of the arena is held
    finally:
        holder.stdin.close()
        holder.wait(30)
        holder.stdout.close()
    assert holder.returncode == 0
    assert chief.wait(30) == 0, chief.output()


def _abstract_sockets(pid: int, prefix: str) -> list[str]:
    """The names of the abstract unix sockets process ``pid`` holds that start with ``prefix``:
    what any local user can read in /proc/net/unix."""
    inodes = socket_inodes(pid)
    with open("/proc/net/unix") as fh:
        rows = [line.split() for line in fh][1:]
    return sorted({r[7][1:] for r in rows if len(r) > 7 and r[6] in inodes and r[7].startswith("@" + prefix)})


def test_a_local_process_holding_every_shm_slot_costs_one_warning_then_a_count(cluster):
    """It connects 16 times and says nothing, twice over: each hello times out after 5 s. The
    chief logs the first failure, then counts the rest (the count when it closes), instead of a
    WARNING per slot every 5 s."""
    chief = cluster.chief("--workers", "1", "--join-timeout", "60")
    # The port file comes before the model is loaded (the chief binds first); the socket after.
    wait_until(lambda: _abstract_sockets(chief.pid, "collective-shm-"), "the chief's shared-memory socket", timeout=60)
    [name] = _abstract_sockets(chief.pid, "collective-shm-")
    for _ in range(2):
        held = []
        for _ in range(16):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\0" + name)
            s.settimeout(30)
            held.append(s)
        try:
            for s in held:
                assert s.recv(64) == b""  # the chief gave up on the hello (after 5 s) and closed it
        finally:
            for s in held:
                s.close()
    wait_until(lambda: "shared-memory request failed" in chief.output(), "the chief's line for the first failure")
    chief.signal(signal.SIGTERM)  # it closes its shared-memory server: the count
    assert chief.wait(30) != 0
    out = chief.output()
    lines = [ln for ln in out.splitlines() if "shared-memory request" in ln]
    assert len(lines) == 2, "\n".join(lines)
    assert "WARNING" in lines[0] and "shared-memory request failed: timed out" in lines[0], lines[0]
    assert "31 more shared-memory request(s) failed or were refused (32 in all)" in lines[1], lines[1]
