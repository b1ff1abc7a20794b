"""The suite's fixtures; what they build lives in tests/clusters.py (one place for clusters)."""

from __future__ import annotations

import logging

import pytest

from collective.config import Timeouts
from tests.clusters import FAST, Cluster


@pytest.fixture(autouse=True)
def _root_logger_restored():
    """Each test leaves the root logger as it found it. An in-process ``collective.cli.main``
    (bench, launch) calls ``logs.configure``: its handler writes to that test's captured stderr,
    closed when the test ends, and every later in-process log line of the session (a data server
    thread ending between two tests) printed "--- Logging error ---" instead."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:], root.level = handlers, level


@pytest.fixture
def fast_timeouts() -> Timeouts:
    return FAST


@pytest.fixture
def cluster(tmp_path):
    """Chief and worker processes started by hand; whatever still runs is killed by pid."""
    c = Cluster(tmp_path)
    yield c
    c.close()
