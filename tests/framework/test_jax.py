"""collective.jax: a pytree of rank 0's values on every process, one copy per local device."""

from __future__ import annotations

import numpy as np
import pytest

from tests.framework.conftest import require
from tests.framework.launchers import spmd_lines

SCRIPT = "examples/jax_sync.py"
LINE = (r"rank (?P<rank>\d): own init (?P<own>\w+) -> synced (?P<synced>\w+) on 2 devices \(all shards equal: True\); "
        r"3 jit steps, replicas equal after: True")


def test_sync_pytree_alone_replicates_every_leaf_on_every_local_device(monkeypatch):
    jax = require("jax")
    import jax.numpy as jnp
    import ml_dtypes

    from collective.jax import device_name, leaf_arrays, sync_pytree

    for var in ("COLLECTIVE_WORLD_SIZE", "COLLECTIVE_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    assert len(jax.local_devices()) == 2, "XLA_FLAGS=--xla_force_host_platform_device_count=2 was not applied"
    bits = np.array([0x7FC3, 0x8000, 0x3F80], "<u2")
    tree = {"w": jnp.asarray(bits.view(ml_dtypes.bfloat16)), "b": [jnp.arange(4.0), jnp.array(3, jnp.int32)]}
    named, _ = leaf_arrays(tree)
    assert list(named) == ["['b'][0]", "['b'][1]", "['w']"]
    out = sync_pytree(tree, rank=0, world_size=1)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    for leaf, original in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(tree), strict=True):
        shards = leaf.addressable_shards
        assert [device_name(s.data.device) for s in shards] == ["cpu:0", "cpu:1"]
        for s in shards:
            assert np.asarray(s.data).tobytes() == np.asarray(original).tobytes()
            assert s.data.dtype == original.dtype
    assert np.asarray(out["w"]).view(np.uint16).tolist() == bits.tolist()  # NaN payload kept


@pytest.mark.integration
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_processes_two_devices_each_hold_rank_0s_tree(dtype):
    require("jax")
    lines = spmd_lines(SCRIPT, 2, LINE, {"JAX_SYNC_DTYPE": dtype})
    assert sorted(lines) == [0, 1]
    assert lines[0]["synced"] == lines[1]["synced"] == lines[0]["own"] != lines[1]["own"]
