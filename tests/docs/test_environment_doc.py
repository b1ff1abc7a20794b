"""Every ``COLLECTIVE_*`` variable the code reads is documented: the environment page lists
those without an option, the generated options page those of every option."""

from __future__ import annotations

import re

from tests.procs import ROOT

_NAME = re.compile(r"COLLECTIVE_[A-Z0-9_]*[A-Z0-9]")


def _names(paths) -> set[str]:
    return {m for p in paths for m in _NAME.findall(p.read_text(errors="replace"))}


def test_every_variable_named_in_the_code_is_documented():
    code = [*ROOT.glob("collective/**/*.py"), *ROOT.glob("tools/**/*.py"), ROOT / "docker-compose.yml"]
    named = _names(code)
    assert "COLLECTIVE_LOG_LEVEL" in named and "COLLECTIVE_DATA_PATH" in named  # the scan finds what it must
    documented = _names([ROOT / "docs/reference/environment.md", ROOT / "docs/reference/options.md"])
    assert sorted(named - documented) == []
