"""TLS and mutual TLS with certificates from scripts/make-certs.sh (what `make certs` runs)."""

from __future__ import annotations

import subprocess

import pytest

from tests.procs import ROOT

pytestmark = pytest.mark.integration

JOIN = ["--join-timeout", "4"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    good = tmp_path_factory.mktemp("certs")
    rogue = tmp_path_factory.mktemp("rogue")
    for out, ids in ((good, ["worker-1", "worker-2", "worker-3"]), (rogue, ["worker-1"])):
        subprocess.run(["bash", str(ROOT / "scripts" / "make-certs.sh"), str(out), *ids], check=True,
                       capture_output=True, timeout=60)
    return good, rogue


def mtls_chief(cluster, certs, workers="1"):
    good, _ = certs
    return cluster.chief("--workers", workers, "--join-timeout", "30", "--tls-cert", str(good / "chief.pem"),
                         "--tls-key", str(good / "chief.key"), "--tls-ca", str(good / "ca.pem"))


def worker_tls(d, name):
    return ["--tls-ca", str(d / "ca.pem"), "--tls-cert", str(d / f"{name}.pem"), "--tls-key", str(d / f"{name}.key")]


def test_mutual_tls_lets_a_worker_with_its_own_certificate_join(cluster, certs):
    good, _ = certs
    chief = mtls_chief(cluster, certs)
    w = cluster.worker("worker-1", *worker_tls(good, "worker-1"), *JOIN)
    assert w.wait(60) == 0, w.output()
    assert chief.wait(30) == 0, chief.output()


def test_a_certificate_for_worker_1_cannot_claim_worker_2(cluster, certs):
    good, _ = certs
    chief = mtls_chief(cluster, certs)
    w = cluster.worker("worker-2", *worker_tls(good, "worker-1"), *JOIN)
    assert w.wait(30) != 0
    assert "worker id 'worker-2' refused: the client certificate names" in w.output()
    assert "worker-1" in w.output()
    assert "refused worker id 'worker-2'" in chief.output()


@pytest.mark.parametrize("case", ["no client certificate", "rogue CA", "plaintext"])
def test_the_handshake_refuses_a_worker_without_a_trusted_certificate(cluster, certs, case):
    good, rogue = certs
    mtls_chief(cluster, certs)
    args = {
        "no client certificate": ["--tls-ca", str(good / "ca.pem")],
        "rogue CA": ["--tls-ca", str(good / "ca.pem"), "--tls-cert", str(rogue / "worker-1.pem"),
                     "--tls-key", str(rogue / "worker-1.key")],
        "plaintext": [],
    }[case]
    w = cluster.worker("worker-1", *args, *JOIN)
    assert w.wait(30) != 0
    out = w.output()
    assert "Traceback" not in out and "training started" not in out
    assert "tls" in out.lower(), out


@pytest.mark.parametrize(
    "args, words",
    [
        (["--tls-ca", "CA"], "--tls-ca (the CA of client certificates) needs the chief's own --tls-cert"),
        (["--tls-cert", "CERT"], "--tls-cert and --tls-key go together"),
    ],
)
def test_a_half_configured_chief_refuses_to_start(cluster, certs, args, words):
    good, _ = certs
    args = [a.replace("CA", str(good / "ca.pem")).replace("CERT", str(good / "chief.pem")) for a in args]
    chief = cluster.chief("--workers", "1", *args, wait_port=False)
    assert chief.wait(30) == 2
    assert words in chief.output() and "Traceback" not in chief.output()


def test_doctor_checks_a_mutual_tls_chief_with_the_workers_certificates(cluster, certs):
    from collective.cli.doctor import run_doctor
    from collective.transport.grpc import TlsFiles

    good, rogue = certs
    mtls_chief(cluster, certs)
    tls = TlsFiles(ca=str(good / "ca.pem"), cert=str(good / "worker-1.pem"), key=str(good / "worker-1.key"))
    checks, ok = run_doctor(cluster.address, token=None, tls=tls)
    by_name = {c.name: c for c in checks}
    assert ok, checks
    assert by_name["tls"].ok is True and "mutual TLS" in by_name["tls"].detail
    assert by_name["grpc health"].ok is True and by_name["token"].ok is True
    bad = TlsFiles(ca=str(good / "ca.pem"), cert=str(rogue / "worker-1.pem"), key=str(rogue / "worker-1.key"))
    checks, ok = run_doctor(cluster.address, token=None, tls=bad)
    assert not ok and {c.name: c for c in checks}["grpc health"].ok is False


CHAIN = ["--workers", "3", "--no-shm", "--chunk-bytes", "65536", "--join-timeout", "60"]
# Who relays to whom (ranks): a chain 0 -> 1 -> 2; a double tree of 3 (topology.dtree_parents):
# tree A 1 -> 0 and 2, tree B 2 -> 0 -> 1.
RELAYS = {"chain": [(0, 1), (1, 2)], "dtree": [(1, 0), (1, 2), (0, 1), (2, 0)]}


def _chain_round(cluster, chief_args, worker_args, topology="chain"):
    """Three workers over the network through relays: a chain (rank 0 from the chief, 1 from 0's
    relay, 2 from 1's) or a double tree."""
    chief = cluster.chief(*CHAIN, "--topology", topology, *chief_args)
    ids = ["worker-1", "worker-2", "worker-3"]
    workers = [cluster.worker(w, "--rank", str(i), "--no-shm", *worker_args(w))
               for i, w in enumerate(ids)]
    for w in workers:
        assert w.wait(90) == 0, w.output()
    assert chief.wait(30) == 0, chief.output()
    assert f"topology {topology}" in chief.output()
    for parent, child in RELAYS[topology]:  # every hop but the first went through a relay
        assert f"relaying to worker {ids[child]}" in workers[parent].output(), workers[parent].output()
    assert len({w.output().rsplit("worker digest ", 1)[1].strip() for w in workers}) == 1


def test_server_only_tls_runs_a_chain_through_the_relays(cluster, certs):
    """Chief --tls-cert/--tls-key, workers --tls-ca only: relays serve TLS with a certificate of
    their own that reaches their children through the chief's plan."""
    good, _ = certs
    _chain_round(cluster, ["--tls-cert", str(good / "chief.pem"), "--tls-key", str(good / "chief.key")],
                 lambda w: ["--tls-ca", str(good / "ca.pem")])


@pytest.mark.parametrize("topology", ["chain", "dtree"])
def test_mutual_tls_runs_a_chain_through_the_relays(cluster, certs, topology):
    """Relays serve their worker certificate and are dialled by IP: verified against the name
    the plan gives them (their worker id), not the address."""
    good, _ = certs
    _chain_round(cluster, ["--tls-cert", str(good / "chief.pem"), "--tls-key", str(good / "chief.key"),
                           "--tls-ca", str(good / "ca.pem")],
                 lambda w: worker_tls(good, w), topology)
