"""Run the services of docker-compose.yml across emulated hosts on one machine (needs root).

Two parts:

* ``load_compose`` (here) reads ``docker-compose.yml`` itself (``yaml.safe_load``, then compose's
  ``${VAR:-default}`` interpolation from a mapping the test gives, as the shell would), so a test
  runs exactly the commands, environment and healthcheck that ``docker compose up`` would.
* the namespace harness (``Topology``, ``Process``, ``wait_all`` ...) lives in
  ``collective.bench.emulate``, which ``collective bench --emulate-hosts`` uses too; it is re-exported
  here so the tests import everything from one place. See that module for how hosts are built
  and cleaned up.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from collective.bench import emulate
from collective.bench.emulate import (  # noqa: F401 - re-exported for the tests
    ETC_NETNS,
    NETNS_RUN,
    SUBNET,
    Host,
    HostProcessError,
    Process,
    Topology,
    local_argv,
    sweep_stale,
    wait_all,
)

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"


# --- the compose file ------------------------------------------------------------------------

_VAR = re.compile(
    r"\$(?:(?P<dollar>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's variable substitution: ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-d}``, ``${VAR-d}``,
    ``${VAR:?err}``, ``${VAR?err}``. Raises ValueError for a required variable that is missing."""

    def sub(m: re.Match) -> str:
        if m["dollar"]:
            return "$"
        name = m["braced"] or m["bare"]
        value = env.get(name)
        op, arg = m["op"], m["arg"] or ""
        if op == ":-":
            return value if value else arg
        if op == "-":
            return arg if value is None else value
        if op == ":?" and not value or op == "?" and value is None:
            raise ValueError(f"required variable {name} is missing: {arg}")
        return value or ""

    return _VAR.sub(sub, text)


def _interpolate_tree(node, env: Mapping[str, str]):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(x, env) for x in node]
    if isinstance(node, dict):
        return {k: _interpolate_tree(v, env) for k, v in node.items()}
    return node


@dataclass(frozen=True)
class Service:
    """One compose service after interpolation, as the harness runs it."""

    name: str
    command: list[str]
    environment: dict[str, str]
    healthcheck: list[str] | None  # argv of the healthcheck test, None when there is none
    config: dict  # the whole interpolated service entry


def _argv(value) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else [str(x) for x in value]


def _environment(value, env: Mapping[str, str]) -> dict[str, str]:
    if isinstance(value, list):  # ["KEY=value", "KEY"]
        value = dict(item.split("=", 1) if "=" in item else (item, None) for item in value)
    out = {}
    for key, v in (value or {}).items():
        if v is None:  # "KEY:" alone passes the variable through from the shell
            if key in env:
                out[key] = env[key]
        elif isinstance(v, bool):
            raise ValueError(f"environment {key}: compose wants a string, not the boolean {v}")
        else:
            out[key] = str(v)
    return out


def _healthcheck(value) -> list[str] | None:
    if not value or value.get("disable"):
        return None
    test = value.get("test")
    if isinstance(test, str):
        return ["sh", "-c", test]
    kind, *rest = test
    if kind == "NONE":
        return None
    if kind == "CMD-SHELL":
        return ["sh", "-c", " ".join(rest)]
    if kind == "CMD":
        return [str(x) for x in rest]
    raise ValueError(f"healthcheck test must start with CMD, CMD-SHELL or NONE, not {kind!r}")


def load_compose(path: Path = COMPOSE_FILE, env: Mapping[str, str] | None = None) -> dict[str, Service]:
    """The services of a compose file, interpolated from ``env`` (default: no variables set)."""
    doc = _interpolate_tree(yaml.safe_load(Path(path).read_text()), dict(env or {}))
    out = {}
    for name, svc in (doc.get("services") or {}).items():
        out[name] = Service(
            name=name,
            command=_argv(svc.get("command") or []),
            environment=_environment(svc.get("environment"), env or {}),
            healthcheck=_healthcheck(svc.get("healthcheck")),
            config=svc,
        )
    return out


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here (a skip reason), or None when they can."""
    return emulate.unavailable_reason("multihost tests", root_hint=" (they run in CI, which runs as root)")
