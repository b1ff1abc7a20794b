"""The command names: ``python -m collective.chief`` / ``collective.worker`` wherever the package
is installed, and ``python -m chief`` / ``python -m worker`` from a checkout (thin shims, not
installed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.procs import ROOT

pytestmark = pytest.mark.integration


def _help(module: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, "--help"], cwd=cwd, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("role", ["chief", "worker"])
def test_the_package_module_runs_from_any_directory(tmp_path, role):
    proc = _help(f"collective.{role}", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: python -m collective.{role} "), proc.stdout


@pytest.mark.parametrize("role", ["chief", "worker"])
def test_the_checkouts_shim_is_the_same_command(role):
    shim, real = _help(role, ROOT), _help(f"collective.{role}", ROOT)
    assert shim.returncode == 0, shim.stderr
    assert shim.stdout == real.stdout


def test_the_shims_are_not_installed_as_top_level_packages():
    import tomllib

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["collective*"]
    for shim in ("chief", "worker"):  # nothing but the shim: the code lives in collective.<role>
        assert sorted(p.name for p in (ROOT / shim).glob("*.py")) == ["__init__.py", "__main__.py"]
