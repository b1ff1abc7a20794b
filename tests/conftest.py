"""The suite's fixtures; what they build lives in tests/clusters.py (one place for clusters)."""

from __future__ import annotations

import pytest

from collective.config import Timeouts
from tests.clusters import FAST, Cluster


@pytest.fixture
def fast_timeouts() -> Timeouts:
    return FAST


@pytest.fixture
def cluster(tmp_path):
    """Chief and worker processes started by hand; whatever still runs is killed by pid."""
    c = Cluster(tmp_path)
    yield c
    c.close()
