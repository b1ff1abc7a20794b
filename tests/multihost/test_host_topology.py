"""Host-aware topology on emulated hosts: several workers per host, each host's link carries the
model once (read from the interface's byte counters inside each host's namespace); on every
host one worker receives from the network and the others map its arena through shared memory."""

from __future__ import annotations

import json
import os
import re
import signal
import uuid

import pytest

from collective.bench import write_spec
from tests.multihost.netns import Topology, wait_all

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(180)]

SIZE = 16 << 20  # large enough for auto to pick a chain between the hosts

# A bulk flow that keeps a link's queue full: a sink on the flooded host, four sending streams.
_SINK = """
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 9000)); s.listen(8)
def drain(c):
    while c.recv(1 << 20):
        pass
while True:
    threading.Thread(target=drain, args=(s.accept()[0],), daemon=True).start()
"""
_FLOOD = """
import socket, sys, threading, time
def send():
    s = socket.create_connection((sys.argv[1], 9000), timeout=10); b = bytes(1 << 16)
    while True:
        s.sendall(b)
for _ in range(4):
    threading.Thread(target=send, daemon=True).start()
time.sleep(600)
"""


def _counter(net: Topology, host: str, which: str) -> int:
    """``/sys/class/net/eth0/statistics/<which>`` as the host itself sees it."""
    out = net.exec(host, ["cat", f"/sys/class/net/eth0/statistics/{which}"])
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def _round(tmp_path, hosts: list[str], workers_per_host: int, *, worker_options: dict[str, list[str]] | None = None,
           shape: dict[str, dict] | None = None, flood: str | None = None, topology: str = "auto"):
    """Chief on host ``chief``; ``workers_per_host`` workers on each of ``hosts``, ranks dealt
    round-robin over the hosts (so rank order alone would cross a host boundary at every hop);
    ``shape`` maps a host to ``Topology.shape``'s arguments for its link; a bulk flow from the
    chief's host keeps the link into host ``flood`` full for the whole round; ``topology``: the chief's.
    Returns the result file, every process's output and each host's rx/tx bytes in the round."""
    spec = write_spec(tmp_path / "model.yaml", SIZE, 16)
    result_file = tmp_path / "result.json"
    env = {"COLLECTIVE_TOKEN": uuid.uuid4().hex}
    n = len(hosts) * workers_per_host
    with Topology(["chief", *hosts], tmp_path) as net:
        for host, how in (shape or {}).items():
            net.shape(host, **how)
        if flood:
            net.run(flood, ["python", "-c", _SINK], name="sink")
            net.exec("chief", ["python", "-c", f"import socket, time\nfor _ in range(100):\n    try:\n"
                               f"        socket.create_connection(({flood!r}, 9000), timeout=1).close(); break\n"
                               f"    except OSError:\n        time.sleep(0.1)"])
            net.run("chief", ["python", "-c", _FLOOD, flood], name="flood")
        before = {h: (_counter(net, h, "rx_bytes"), _counter(net, h, "tx_bytes")) for h in ["chief", *hosts]}
        chief = net.run("chief", ["python", "-m", "collective.chief", "--workers", str(n), "--model", str(spec),
                                  "--bind", "0.0.0.0:50051", "--result-file", str(result_file),
                                  "--ready-timeout", "60", "--join-timeout", "60", "--topology", topology],
                        env=env, name="chief")
        chief.wait_for("serving on", 60)
        procs = []
        for rank in range(n):
            host = hosts[rank % len(hosts)]
            name = f"{host}-w{rank}"
            extra = (worker_options or {}).get(name, [])
            procs.append(net.run(host, ["python", "-m", "collective.worker", "--chief", "chief:50051", "--worker-id", name,
                                        "--rank", str(rank), "--join-timeout", "60", *extra], env=env, name=name))
        codes = wait_all([chief, *procs], 150)
        outputs = {p.name: p.output() for p in [chief, *procs]}
        moved = {h: (_counter(net, h, "rx_bytes") - before[h][0], _counter(net, h, "tx_bytes") - before[h][1])
                 for h in ["chief", *hosts]}
    assert codes == dict.fromkeys(codes, 0), outputs
    result = json.loads(result_file.read_text())
    assert result["ok"] is True, result["error"]
    return result, outputs, moved


# auto: a chain between the three hosts' leaders; dtree: both trees over them, each leader
# receiving half the chunks from each of its two parents (still the model once per host link).
@pytest.mark.parametrize(("topology", "laid_out"), [("auto", "chain"), ("dtree", "dtree")])
def test_each_host_receives_the_model_once_and_its_other_workers_map_the_receivers_arena(tmp_path, namespaces,
                                                                                       report_figure, topology,
                                                                                       laid_out):
    hosts = ["host-a", "host-b", "host-c"]
    result, outputs, moved = _round(tmp_path, hosts, 3, topology=topology)
    size = result["bytes"]
    # Bit-identical everywhere: one worker digest, reported by all nine workers.
    digests = {w["digest"] for w in result["workers"]}
    assert len(result["workers"]) == 9 and len(digests) == 1 and "" not in digests
    for h in hosts:
        rx, _ = moved[h]
        # Once, plus framing, headers and control messages: not three times.
        assert size <= rx <= 1.10 * size, (h, rx, size)
        here = {name: out for name, out in outputs.items() if name.startswith(h)}
        via_net = [name for name, out in here.items() if "through the network" in out]
        via_shm = [name for name, out in here.items() if "through shared memory" in out]
        assert len(via_net) == 1 and len(via_shm) == 2, {n: re.findall(r"(?:received|mapped) \d+ bytes through [a-z ]+", o)
                                                         for n, o in here.items()}
    # The chief's link carries it once too: the hosts form a chain (or a double tree), not a star.
    assert moved["chief"][1] <= 1.10 * size, moved["chief"]
    assert re.search(rf"topology {laid_out} over 3 network receiver\(s\); workers on 3 host\(s\)", outputs["chief"]), outputs["chief"]
    report_figure(
        f"host topology ({laid_out}): 9 workers on 3 hosts, {size} bytes; bytes received per host link: "
        + ", ".join(f"{h} {moved[h][0]} ({moved[h][0] / size:.3f}x)" for h in hosts)
        + f"; chief sent {moved['chief'][1]} ({moved['chief'][1] / size:.3f}x)"
    )


def test_a_peer_without_shared_memory_takes_the_bytes_from_its_hosts_receiver_not_across_the_link(tmp_path, namespaces):
    hosts = ["host-a", "host-b"]
    # host-b's second worker (rank 3) refuses shared memory: it streams from rank 1 on its host.
    result, outputs, moved = _round(tmp_path, hosts, 2, worker_options={"host-b-w3": ["--no-shm"]})
    size = result["bytes"]
    assert len({w["digest"] for w in result["workers"]}) == 1
    assert "through the network" in outputs["host-b-w3"] and "through shared memory" in outputs["host-a-w2"]
    for h in hosts:
        assert size <= moved[h][0] <= 1.10 * size, (h, moved[h], size)


def test_a_relay_behind_a_busy_slow_link_is_reached_and_the_round_completes(tmp_path, namespaces):
    # host-a's link is slow, its queue deep and kept full by a bulk flow: every packet into
    # host-a waits about 600 ms, host-b's connection to its relay on host-a included. gRPC gave
    # each connection attempt only 100 ms (min_reconnect_backoff_ms doubles as the connect
    # timeout), so host-b failed its round: "relay worker host-a-w0 ... connect() timed out".
    result, outputs, _ = _round(tmp_path, ["host-a", "host-b"], 1,
                                shape={"host-a": {"rate": "20mbit", "queue": "600ms"}}, flood="host-a")
    assert re.search(r"topology chain over 2 network receiver", outputs["chief"]), outputs["chief"]
    assert "receiving from relay worker host-a-w0 (rank 0)" in outputs["host-b-w1"], outputs["host-b-w1"]
    assert len({w["digest"] for w in result["workers"]}) == 1


def test_a_host_leader_killed_mid_stream_is_named_and_its_peers_and_the_next_host_end_too(tmp_path, namespaces):
    spec = write_spec(tmp_path / "model.yaml", SIZE, 16)
    result_file = tmp_path / "result.json"
    env = {"COLLECTIVE_TOKEN": uuid.uuid4().hex}
    with Topology(["chief", "host-a", "host-b"], tmp_path) as net:
        net.shape("host-a", "20mbit")  # 16 MiB take about 7 s to reach host-a's leader
        chief = net.run("chief", ["python", "-m", "collective.chief", "--workers", "4", "--model", str(spec), "--bind",
                                  "0.0.0.0:50051", "--result-file", str(result_file), "--ready-timeout", "120"],
                        env=env, name="chief")
        chief.wait_for("serving on", 60)
        procs = {}
        for rank, host in enumerate(["host-a", "host-b", "host-a", "host-b"]):
            name = f"{host}-w{rank}"
            procs[name] = net.run(host, ["python", "-m", "collective.worker", "--chief", "chief:50051", "--worker-id", name,
                                         "--rank", str(rank)], env=env, name=name)
        leader = procs["host-a-w0"]
        leader.wait_for("relaying to worker host-b-w1", 60)  # the stream runs: host-a feeds host-b
        os.kill(leader.pid, signal.SIGKILL)
        codes = wait_all([chief, *procs.values()], 60)
        outputs = {n: p.output() for n, p in [("chief", chief), *procs.items()]}
    result = json.loads(result_file.read_text())
    assert codes["chief"] == 1 and result["ok"] is False
    # The chief's verdict names the dead leader: lost (its presence call cut off), or the relay that
    # failed its child on the next host, whichever the chief heard first.
    assert re.search(r"worker host-a-w0 \(rank 0, host host-a\) was lost during the broadcast"
                     r"|relay worker host-a-w0 \(rank 0\), which this worker receives from, failed", result["error"]), result
    # Everyone below it ends (no one waits out a deadline): named by its parent that stopped
    # serving, or by the chief's verdict if the heartbeat brought it first.
    parent = {"host-a-w2": "host-a-w0", "host-b-w1": "host-a-w0", "host-b-w3": "host-b-w1"}
    for name, up in parent.items():
        assert codes[name] == 1, outputs[name]
        named = re.search(rf"ERROR worker .*(relay worker {up} .*failed during receive|round aborted by the chief)",
                          outputs[name])
        assert named, outputs[name] + "\n--- chief ---\n" + outputs["chief"]
