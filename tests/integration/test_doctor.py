"""collective doctor against a real chief process, a closed port and bad input."""

from __future__ import annotations

import io
import json
import socket
import sys
import threading

import pytest

from collective.cli.doctor import Check, doctor_command, format_checks, run_doctor
from collective.errors import UsageError
from tests.clusters import Cluster

pytestmark = pytest.mark.integration

TOKEN = "T-doctor-test"
CLUSTER_VARS = ("TF_CONFIG", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


@pytest.fixture(autouse=True)
def no_cluster_env(monkeypatch):
    for name in CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def chief(tmp_path_factory):
    """One chief waiting for a worker that never comes (30 s join timeout), killed at the end."""
    cluster = Cluster(tmp_path_factory.mktemp("doctor"))
    try:
        proc = cluster.chief("--workers", "1", "--token", TOKEN, "--join-timeout", "30")
        yield cluster.address, proc
    finally:
        cluster.close()


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_reachable_chief_with_the_right_token_passes_every_check(chief):
    address, _ = chief
    checks, ok = run_doctor(address, token=TOKEN)
    c = by_name(checks)
    assert ok is True, format_checks(checks)
    assert all(check.ok is not False for check in checks)
    for name in ("resolve", "connect", "grpc health", "token"):
        assert c[name].ok is True, c[name]
    assert c["resolve"].detail == "127.0.0.1 -> 127.0.0.1"
    assert c["connect"].detail.startswith(f"{address} reachable from 127.0.0.1:")
    if sys.platform.startswith("linux"):
        assert c["connect"].detail.endswith("(interface lo)")
    assert c["grpc health"].detail == "collective.v1.Collective: SERVING"
    assert c["token"].detail == "token accepted; chief phase joining, 0/1 workers joined"
    assert c["tls"].ok is None and c["tls"].detail.startswith("TLS: not configured (plaintext)")
    for name in ("python", "grpc", "numpy", "mpi4py", "mpiexec", "cluster env"):
        assert c[name].ok is None, c[name]
    text = format_checks(checks)
    assert "OK    token" in text and "INFO  python" in text
    assert text.splitlines()[-1] == "verdict: OK (4 checks passed, none failed)"


def test_a_wrong_token_fails_the_token_check_only(chief):
    address, proc = chief
    checks, ok = run_doctor(address, token="not-the-token")
    c = by_name(checks)
    assert ok is False
    assert c["token"].ok is False and c["token"].detail.startswith("token refused (UNAUTHENTICATED)")
    assert [x.name for x in checks if x.ok is False] == ["token"]
    assert c["grpc health"].ok is True  # the health service needs no token
    assert format_checks(checks).splitlines()[-1].startswith("verdict: FAIL (1 of ")
    assert "not-the-token" not in proc.output()


def test_no_token_against_a_chief_that_requires_one_says_so(chief):
    address, _ = chief
    checks, ok = run_doctor(address, token=None)
    assert ok is False
    assert by_name(checks)["token"].detail.startswith("no token set, and the chief requires one")


def test_a_closed_port_fails_connect_and_the_overall_verdict():
    port = closed_port()
    checks, ok = run_doctor(f"127.0.0.1:{port}", token=TOKEN, timeout=2.0)
    c = by_name(checks)
    assert ok is False
    assert c["resolve"].ok is True
    assert c["connect"].ok is False and "connection refused" in c["connect"].detail
    assert c["grpc health"].verdict == c["token"].verdict == "SKIP"
    out = io.StringIO()
    assert doctor_command(f"127.0.0.1:{port}", token=None, timeout=2.0, out=out) == 1
    assert out.getvalue().splitlines()[-1] == f"verdict: FAIL (1 of {len(checks)} checks failed: connect)"


def test_a_port_that_does_not_speak_grpc_fails_the_health_check():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        held: list[socket.socket] = []
        stop = threading.Event()

        def accept() -> None:
            server.settimeout(0.2)
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                held.append(conn)  # accept and say nothing

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        try:
            checks, ok = run_doctor(f"127.0.0.1:{port}", token=None, timeout=1.0)
        finally:
            stop.set()
            t.join(5)
            for conn in held:
                conn.close()
    c = by_name(checks)
    assert ok is False and c["connect"].ok is True
    assert c["grpc health"].ok is False
    assert c["token"].verdict == "SKIP"


def test_a_name_that_does_not_resolve_fails_resolve(monkeypatch):
    def fail(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    checks, ok = run_doctor("no-such-host.invalid:50051", token=None)
    c = by_name(checks)
    assert ok is False
    assert c["resolve"].detail == "no-such-host.invalid does not resolve: Name or service not known"
    assert [c[n].verdict for n in ("connect", "grpc health", "token")] == ["SKIP"] * 3


@pytest.mark.parametrize("address", ["chief-host", "chief-host:http", "chief-host:70000", ":50051", "chief-host:0"])
def test_a_bad_address_form_is_a_usage_error(address):
    with pytest.raises(UsageError) as exc:
        run_doctor(address, token=None)
    assert exc.value.exit_code == 2 and address in str(exc.value)


def test_without_a_chief_only_local_checks_run_and_nothing_fails():
    checks, ok = run_doctor(None, token=None)
    assert ok is True
    assert [c.name for c in checks][-1] == "chief"
    assert format_checks(checks).splitlines()[-1].startswith("verdict: OK (local information only")


def test_a_malformed_tf_config_fails_the_cluster_env_check(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{broken")
    checks, ok = run_doctor(None, token=None)
    assert ok is False
    assert by_name(checks)["cluster env"].detail.startswith("TF_CONFIG: not valid JSON")


def test_doctor_command_takes_the_chief_from_tf_config_and_prints_json(chief, monkeypatch):
    address, _ = chief
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"chief": [address], "worker": ["w0:1"]}, "task": {"type": "worker", "index": 0}}
    ))
    out = io.StringIO()
    assert doctor_command(None, token=TOKEN, as_json=True, out=out) == 0
    report = json.loads(out.getvalue())
    assert report["ok"] is True and report["chief"] == address
    verdicts = {c["name"]: c["verdict"] for c in report["checks"]}
    assert verdicts["token"] == "OK"
    assert verdicts["cluster env"] == "INFO"
