"""The vLLM engine tests need vLLM's CPU build, which has an environment of its own.

``make test`` runs them in ``.venv-vllm`` (``make vllm-env``: ``pip install -e .[vllm]``) with
``COLLECTIVE_REQUIRE_VLLM=1``: there a missing vLLM fails them. The main suite's environment has
no vLLM (its pins are not the frameworks'), so there they skip, saying where they run.
"""

from __future__ import annotations

import importlib
import os

import pytest


def require_vllm():
    """Import vllm, or skip (fail where ``COLLECTIVE_REQUIRE_VLLM=1``)."""
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        if os.environ.get("COLLECTIVE_REQUIRE_VLLM") == "1":
            pytest.fail(f"vllm is required here (COLLECTIVE_REQUIRE_VLLM=1) but cannot be imported: {exc}")
        pytest.skip("vLLM is not in this environment: these tests run in their own (make test-vllm)",
                    allow_module_level=True)
