"""docker-compose.yml and the Dockerfile: docker-compose's own checker, and what the file must say.

No Docker engine runs here; `docker-compose config` (the Debian package docker-compose) needs
none. The services themselves run across emulated hosts in tests/multihost/.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from tests.multihost.netns import COMPOSE_FILE, ROOT, interpolate, load_compose

CHECKER = shutil.which("docker-compose")


@pytest.fixture
def clean_env(monkeypatch):
    """No COLLECTIVE_* from the developer's shell leaks into the checks."""
    for key in list(os.environ):
        if key.startswith("COLLECTIVE_"):
            monkeypatch.delenv(key)
    return {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}


def docker_compose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    if CHECKER is None:
        reason = (
            "docker-compose is not installed (Debian package docker-compose: "
            "apt-get install -y docker-compose); CI's setup must install it"
        )
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return subprocess.run(
        [CHECKER, "--project-directory", str(ROOT), "-f", str(COMPOSE_FILE), *args],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
    )


def cli_parsers():
    from collective.chief.__main__ import build_parser as chief_parser
    from collective.worker.__main__ import build_parser as worker_parser

    return {"chief": chief_parser, "worker": worker_parser}


def env_names(parser) -> set[str]:
    from collective.config import env_name

    return {env_name(a.option_strings[0][2:]) for a in parser._actions if a.option_strings[0].startswith("--")
            and a.dest != "help"}


# --- docker-compose's own checker ------------------------------------------------------------------


def test_docker_compose_accepts_the_file_without_a_dot_env(clean_env):
    checked = docker_compose("config", "-q", env=clean_env)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout == ""


@pytest.mark.parametrize("shell", [{}, {"COLLECTIVE_WORKERS": "5", "COLLECTIVE_MODEL": "/models/m.safetensors",
                                        "COLLECTIVE_TOKEN": "s3cret", "COLLECTIVE_JOIN_TIMEOUT": ""}])
def test_the_harness_reads_the_file_as_docker_compose_does(clean_env, shell):
    rendered = docker_compose("config", env=clean_env | shell)
    assert rendered.returncode == 0, rendered.stderr
    theirs = yaml.safe_load(rendered.stdout)["services"]
    ours = load_compose(env=shell)
    assert set(theirs) == set(ours) == {"chief", "worker"}
    for name, svc in ours.items():
        assert svc.command == theirs[name]["command"]
        assert svc.environment == {k: str(v) for k, v in theirs[name]["environment"].items()}
        if svc.healthcheck is not None:
            assert ["CMD", *svc.healthcheck] == theirs[name]["healthcheck"]["test"]


# --- what the file says --------------------------------------------------------------------------


def test_chief_and_worker_services_run_the_clis_configured_only_by_variables_they_read(clean_env):
    services = load_compose()
    assert set(services) == {"chief", "worker"}
    for name, parser in cli_parsers().items():
        svc = services[name]
        assert svc.command == ["python", "-m", f"collective.{name}"]  # installed, not a checkout's shim
        unknown = set(svc.environment) - env_names(parser())
        assert not unknown, f"{name}: variables python -m collective.{name} does not read: {sorted(unknown)}"
        assert svc.config["stop_grace_period"]
        assert svc.config["init"] is True  # SIGTERM reaches python, which is not PID 1
        assert svc.config["image"] == services["chief"].config["image"]
    chief, worker = services["chief"], services["worker"]
    assert {"COLLECTIVE_WORKERS", "COLLECTIVE_MODEL", "COLLECTIVE_TOKEN", "COLLECTIVE_JOIN_TIMEOUT",
            "COLLECTIVE_READY_TIMEOUT", "COLLECTIVE_LOG_FORMAT", "COLLECTIVE_BIND"} <= set(chief.environment)
    assert {"COLLECTIVE_CHIEF", "COLLECTIVE_TOKEN", "COLLECTIVE_JOIN_TIMEOUT", "COLLECTIVE_DEVICES",
            "COLLECTIVE_STALL_TIMEOUT", "COLLECTIVE_START_TIMEOUT", "COLLECTIVE_LOG_FORMAT"} <= set(worker.environment)
    # Workers reach the chief by its service name, on the port it binds.
    port = chief.environment["COLLECTIVE_BIND"].rpartition(":")[2]
    assert worker.environment["COLLECTIVE_CHIEF"] == f"chief:{port}"
    assert chief.environment["COLLECTIVE_MODEL"] == "mlp"
    # Scaling needs replicas without a fixed name, host name, host port or worker id.
    for key in ("container_name", "hostname", "ports"):
        assert key not in worker.config, key
    assert "COLLECTIVE_WORKER_ID" not in worker.environment and "COLLECTIVE_RANK" not in worker.environment


def test_compose_defaults_are_the_clis_own_except_the_cluster_size_and_the_chief_address(clean_env, monkeypatch):
    services = load_compose()
    for name, make_parser in cli_parsers().items():
        plain = vars(make_parser().parse_args([]))
        for key, value in services[name].environment.items():
            monkeypatch.setenv(key, value)
        configured = vars(make_parser().parse_args([]))
        for key in services[name].environment:
            monkeypatch.delenv(key)
        differs = {k for k in plain if plain[k] != configured[k]}
        assert differs == ({"workers"} if name == "chief" else {"chief"}), (name, plain, configured)


def test_chief_healthcheck_asks_the_grpc_health_service_and_passes_only_when_serving(clean_env):
    chief = load_compose()["chief"]
    check = chief.healthcheck
    assert check is not None and check[:2] == ["python", "-c"]
    code = check[2]
    compile(code, "healthcheck", "exec")
    assert "grpc_health.v1" in code and "HealthCheckResponse.SERVING" in code and "sys.exit(0 if" in code
    port = chief.environment["COLLECTIVE_BIND"].rpartition(":")[2]
    assert f"127.0.0.1:{port}" in code
    hc = chief.config["healthcheck"]
    assert hc["interval"] and hc["timeout"] and hc["retries"] >= 1 and hc["start_period"]


def test_the_models_volume_is_mounted_read_only_for_your_own_checkpoint(clean_env):
    chief = load_compose()["chief"]
    assert "./models:/models:ro" in chief.config["volumes"]
    assert "/models:ro" in load_compose(env={"COLLECTIVE_MODELS_DIR": "/data/ckpt"})["chief"].config["volumes"][0]


def test_the_dockerfile_installs_the_package_on_python_slim_and_runs_as_a_non_root_user():
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    assert any(ln.startswith("RUN") and "pip install" in ln and " ." in ln for ln in lines)
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert any(ln.startswith("CMD") and '"-m"' in ln for ln in lines)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignored)


@pytest.mark.parametrize(
    ("text", "env", "want"),
    [
        ("${A:-x}", {}, "x"),
        ("${A:-x}", {"A": ""}, "x"),
        ("${A-x}", {"A": ""}, ""),
        ("${A:-x}", {"A": "y"}, "y"),
        ("$A/${B}", {"A": "1", "B": "2"}, "1/2"),
        ("$${A}", {"A": "1"}, "${A}"),
        ("${A:-}", {}, ""),
    ],
)
def test_interpolation_follows_compose(text, env, want):
    assert interpolate(text, env) == want


def test_a_required_variable_that_is_missing_is_an_error():
    with pytest.raises(ValueError, match="A is missing: set it"):
        interpolate("${A:?set it}", {})
