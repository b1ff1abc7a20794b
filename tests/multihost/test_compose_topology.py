"""The services of docker-compose.yml, run across emulated hosts (network namespaces, needs root).

Each host has its own network namespace and address on a private bridge, its own host name and
/dev/shm, and resolves the service names through /etc/netns/<ns>/hosts. Commands, environment and
the healthcheck come from docker-compose.yml itself; see tests/multihost/netns.py.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import pytest

from tests.multihost.netns import ETC_NETNS, NETNS_RUN, Topology, load_compose, wait_all

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(120)]

WORKERS = ["worker-1", "worker-2", "worker-3"]


def compose_env(**overrides: str) -> dict[str, str]:
    """The shell variables a user would set before `docker compose up`, shrunk for tests."""
    env = {
        "COLLECTIVE_WORKERS": "3",
        "COLLECTIVE_MODEL": "mlp",
        "COLLECTIVE_TOKEN": uuid.uuid4().hex,
        "COLLECTIVE_JOIN_TIMEOUT": "30",
        "COLLECTIVE_READY_TIMEOUT": "30",
        "COLLECTIVE_STALL_TIMEOUT": "10",
        "COLLECTIVE_START_TIMEOUT": "30",
    }
    env.update(overrides)
    return env


def test_each_host_has_its_own_address_name_and_shm_and_resolves_the_service_names(tmp_path, namespaces):
    probe = (
        "import json, os, socket; "
        "open('/dev/shm/mark-' + socket.gethostname(), 'w').close(); "
        "print(json.dumps({'hostname': socket.gethostname(), "
        "'chief': socket.gethostbyname('chief'), 'worker-1': socket.gethostbyname('worker-1'), "
        "'shm': sorted(os.listdir('/dev/shm')), 'links': sorted(os.listdir('/sys/class/net'))}))"
    )
    with Topology(["chief", "worker-1"], tmp_path) as net:
        addresses = {h: net.hosts[h].address for h in ("chief", "worker-1")}
        for host in ("chief", "worker-1"):
            out = net.exec(host, ["python", "-c", probe])
            assert out.returncode == 0, out.stderr
            seen = json.loads(out.stdout)
            assert seen["hostname"] == host
            assert {"chief": seen["chief"], "worker-1": seen["worker-1"]} == addresses
            # A private /dev/shm: each host sees only its own mark.
            assert seen["shm"] == [f"mark-{host}"]
            # Its own links only, nothing of the machine's.
            assert seen["links"] == ["eth0", "lo"]
        assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith("mark-")]
        # The hosts reach each other over the bridge, and not once the cable is cut.
        reach = ("import socket, sys; s = socket.socket(); s.settimeout(1.0); "
                 "r = s.connect_ex(('worker-1', 9)); sys.exit(0 if r == 111 else 1)")  # 111: refused = reached
        assert net.exec("chief", ["python", "-c", reach]).returncode == 0
        net.cut("worker-1")
        assert net.exec("chief", ["python", "-c", reach]).returncode != 0
        leftovers = [net.switch] + [h.ns for h in net.hosts.values()]
    for name in leftovers:
        assert not (NETNS_RUN / name).exists() and not (ETC_NETNS / name).exists(), name


def test_chief_and_three_workers_from_the_compose_file_start_with_identical_digests(tmp_path, namespaces, report_figure):
    services = load_compose(env=compose_env())
    chief_svc, worker_svc = services["chief"], services["worker"]
    result_file = tmp_path / "result.json"
    with Topology(["chief", *WORKERS], tmp_path) as net:
        # The first worker starts before the chief: it must retry until the chief serves.
        workers = [net.run_service(worker_svc, WORKERS[0])]
        chief = net.run_service(chief_svc, "chief", extra_env={"COLLECTIVE_RESULT_FILE": str(result_file)})
        chief.wait_for(r"serving on 0\.0\.0\.0:50051", 30)
        health = net.exec("chief", chief_svc.healthcheck)
        assert health.returncode == 0, f"healthcheck failed while the chief serves:\n{health.stderr}"
        workers += [net.run_service(worker_svc, host) for host in WORKERS[1:]]

        codes = wait_all([chief, *workers], 60)
        logs = {p.name: p.output() for p in [chief, *workers]}
        assert codes == dict.fromkeys(codes, 0), logs
        health_after = net.exec("chief", chief_svc.healthcheck)
        received = {host: net.link_bytes(host)["rx"] for host in WORKERS}

    result = json.loads(result_file.read_text())
    assert result["ok"] is True and result["error"] is None
    assert sorted(w["host"] for w in result["workers"]) == WORKERS
    digests = {w["digest"] for w in result["workers"]}
    assert len(digests) == 1 and "" not in digests, result["workers"]
    for p, w in zip(workers, sorted(result["workers"], key=lambda w: w["host"]), strict=True):
        line = re.search(r"training started: .* worker digest (\w+)", logs[p.name])
        assert line, logs[p.name]
        assert line.group(1) == w["digest"] and w["id"] == f"{p.host}-{p.pid}"
        # Every worker's bytes came across its own link, not a same-host shortcut.
        assert received[p.host] >= result["bytes"], (p.host, received[p.host])
    assert "training started: 3 workers hold identical variables" in logs["chief"]
    # The chief has stopped: nothing answers the healthcheck any more.
    assert health_after.returncode != 0

    report_figure(
        f"compose topology: {len(result['workers'])} workers on {len(WORKERS) + 1} hosts, "
        f"model {result['model']}, {result['bytes']} bytes broadcast in {result['seconds']:.3f} s "
        f"(first byte sent to every worker ready), identical digest {digests.pop()[:16]}…; "
        f"bytes received per worker link: {', '.join(f'{h} {b}' for h, b in received.items())}"
    )


def test_a_worker_whose_link_is_cut_after_joining_is_named_by_the_chief(tmp_path, namespaces, report_figure):
    lease = 1.5
    # A star: in a tree the cut worker may be another's relay, and that one could not finish.
    services = load_compose(env=compose_env(
        COLLECTIVE_HEARTBEAT_INTERVAL="0.3", COLLECTIVE_HEARTBEAT_TIMEOUT=str(lease), COLLECTIVE_READY_TIMEOUT="60",
        COLLECTIVE_TOPOLOGY="star",
    ))
    chief_svc, worker_svc = services["chief"], services["worker"]
    result_file = tmp_path / "result.json"
    with Topology(["chief", *WORKERS], tmp_path) as net:
        chief = net.run_service(chief_svc, "chief", extra_env={"COLLECTIVE_RESULT_FILE": str(result_file)})
        chief.wait_for("serving on", 30)
        w1, w2 = (net.run_service(worker_svc, host) for host in WORKERS[:2])
        for w in (w1, w2):
            w.wait_for("waiting for the plan", 30)
        net.cut("worker-2")
        cut_at = time.monotonic()
        w3 = net.run_service(worker_svc, "worker-3")

        # The cut worker hears nobody: it must give up by itself too, naming the chief.
        codes = wait_all([chief, w1, w2, w3], 60)
        chief_log = chief.output()
        outputs = {w.name: w.output() for w in (w1, w2, w3)}
    chief_code, w1_code, w2_code, w3_code = codes.values()
    chief_seconds, w2_seconds = chief.ended - cut_at, w2.ended - cut_at

    cut_id = f"worker-2-{w2.pid}"
    # The heartbeat lease catches the cut: the chief names that worker, by id and host, and no
    # other, well before the 60 s ready timeout.
    named = rf"worker {cut_id} \(rank \d, host worker-2\) was lost during the broadcast: no heartbeat"
    assert chief_code == 1, chief_log
    result = json.loads(result_file.read_text())
    assert result["ok"] is False and re.search(named, result["error"] or ""), result["error"]
    assert f"{w1.host}-{w1.pid}" not in result["error"] and f"{w3.host}-{w3.pid}" not in result["error"]
    assert re.search(rf"ERROR chief .*{named}", chief_log), chief_log
    assert chief_seconds < lease + 10, chief_log
    # The healthy workers had the plan and waited for every worker to prepare (the barrier before
    # the first byte), and hear from the chief who is at fault.
    for w, code in ((w1, w1_code), (w3, w3_code)):
        assert code == 1, outputs[w.name]
        assert re.search(r"phase=receive: plan: \d+ variables", outputs[w.name]), outputs[w.name]
        assert re.search(rf"round aborted by the chief at chief:50051: .*{named}", outputs[w.name]), outputs[w.name]
    assert w2_code == 1, outputs["worker-2"]
    # Today: "chief at chief:50051 unreachable during join (waiting for the plan): … No route to host".
    assert re.search(r"ERROR worker .*chief at chief:50051", outputs["worker-2"]), outputs["worker-2"]

    report_figure(
        f"cut link: chief named {cut_id} and exited {chief_code} {chief_seconds:.1f} s after the cut "
        f"(heartbeat lease {lease} s, then up to 5 s for the cut worker to hear it); the cut worker exited {w2_code} after "
        f"{w2_seconds:.1f} s naming the chief as unreachable"
    )



def test_a_slow_link_completes_with_identical_digests_and_no_false_heartbeat_timeouts(tmp_path, namespaces, report_figure):
    """Case 14: one worker behind a 20 Mbit/s link, heartbeats every 0.3 s with a 1.5 s lease."""
    spec = tmp_path / "model.yaml"
    spec.write_text("seed: 1\nvariables:\n  - {name: w, shape: [1024, 1536], dtype: float32, initializer: glorot_uniform}\n")
    env = compose_env(COLLECTIVE_WORKERS="2", COLLECTIVE_MODEL=str(spec), COLLECTIVE_HEARTBEAT_INTERVAL="0.3",
                      COLLECTIVE_HEARTBEAT_TIMEOUT="1.5", COLLECTIVE_CHUNK_BYTES="1048576")
    services = load_compose(env=env)
    result_file = tmp_path / "result.json"
    with Topology(["chief", "worker-1", "worker-2"], tmp_path) as net:
        net.shape("worker-2", "20mbit")
        chief = net.run_service(services["chief"], "chief", extra_env={"COLLECTIVE_RESULT_FILE": str(result_file)})
        chief.wait_for("serving on", 30)
        workers = [net.run_service(services["worker"], h) for h in ("worker-1", "worker-2")]
        codes = wait_all([chief, *workers], 90)
        chief_log = chief.output()
    assert set(codes.values()) == {0}, chief_log
    result = json.loads(result_file.read_text())
    assert result["ok"] is True and len({w["digest"] for w in result["workers"]}) == 1
    assert "no heartbeat" not in chief_log and "lost" not in chief_log
    seconds = result["seconds"]
    # 6 MiB over 20 Mbit/s takes at least 2.5 s: the shaping was real.
    assert seconds > 2.0, seconds
    report_figure(f"slow link: {result['bytes']} bytes to 2 workers, one behind 20 Mbit/s, in {seconds:.2f} s; "
                  f"heartbeat lease 1.5 s, no false timeout")
