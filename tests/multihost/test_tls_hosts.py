"""TLS across emulated hosts: a chain whose relays are dialled by their IP address on the bridge.

Certificates come from scripts/make-certs.sh (the chief's names `chief`, the name workers dial);
the services are the compose file's, with the COLLECTIVE_TLS_* variables SECURITY.md gives.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.multihost.netns import Topology, load_compose, wait_all
from tests.multihost.test_compose_topology import WORKERS, compose_env
from tests.procs import ROOT

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(150)]


@pytest.mark.parametrize("mode", ["server-only TLS", "mutual TLS"])
def test_a_tls_chain_across_hosts_goes_through_every_relay(tmp_path, namespaces, mode):
    certs = tmp_path / "certs"
    subprocess.run(["bash", str(ROOT / "scripts" / "make-certs.sh"), str(certs), *WORKERS], check=True,
                   capture_output=True, timeout=60)
    services = load_compose(env=compose_env(COLLECTIVE_TOPOLOGY="chain", COLLECTIVE_CHUNK_BYTES="65536"))
    chief_env = {"COLLECTIVE_TLS_CERT": str(certs / "chief.pem"), "COLLECTIVE_TLS_KEY": str(certs / "chief.key"),
                 "COLLECTIVE_RESULT_FILE": str(tmp_path / "result.json")}
    if mode == "mutual TLS":
        chief_env["COLLECTIVE_TLS_CA"] = str(certs / "ca.pem")

    def worker_env(rank: int, host: str) -> dict[str, str]:
        env = {"COLLECTIVE_TLS_CA": str(certs / "ca.pem"), "COLLECTIVE_WORKER_ID": host, "COLLECTIVE_RANK": str(rank)}
        if mode == "mutual TLS":
            env |= {"COLLECTIVE_TLS_CERT": str(certs / f"{host}.pem"), "COLLECTIVE_TLS_KEY": str(certs / f"{host}.key")}
        return env

    with Topology(["chief", *WORKERS], tmp_path) as net:
        chief = net.run_service(services["chief"], "chief", extra_env=chief_env)
        chief.wait_for("serving on", 30)
        workers = [net.run_service(services["worker"], h, extra_env=worker_env(i, h)) for i, h in enumerate(WORKERS)]
        codes = wait_all([chief, *workers], 90)
        logs = {p.name: p.output() for p in [chief, *workers]}
        received = {h: net.link_bytes(h)["rx"] for h in WORKERS}
    assert set(codes.values()) == {0}, logs
    assert "topology chain" in logs["chief"], logs["chief"]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["ok"] is True and len({w["digest"] for w in result["workers"]}) == 1
    # rank 1 took its bytes from rank 0's relay, rank 2 from rank 1's, across the bridge
    for parent, child in zip(workers[:-1], WORKERS[1:], strict=True):
        assert f"relaying to worker {child}" in logs[parent.name], logs[parent.name]
    for host in WORKERS:
        assert received[host] >= result["bytes"], (host, received[host])
