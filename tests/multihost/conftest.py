"""Multihost tests run services in network namespaces: they need root and skip, saying why, without it."""

from __future__ import annotations

import pytest

from tests.multihost.netns import unavailable_reason

_FIGURES: list[str] = []


@pytest.fixture(scope="session")
def namespaces() -> None:
    """Skip (with the reason) where network namespaces cannot be made, e.g. when not root."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def report_figure():
    """Record one line for the 'multihost figures' section printed at the end of the run."""
    return _FIGURES.append


def pytest_terminal_summary(terminalreporter) -> None:
    if _FIGURES:
        terminalreporter.section("multihost figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)
