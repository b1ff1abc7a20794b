"""JAX: every process starts from rank 0's parameters, one copy on each local device.

Two processes with two (host) devices each, on one machine::

    export XLA_FLAGS=--xla_force_host_platform_device_count=2
    COLLECTIVE_RANK=0 COLLECTIVE_WORLD_SIZE=2 COLLECTIVE_CHIEF=127.0.0.1:50051 python examples/jax_sync.py &
    COLLECTIVE_RANK=1 COLLECTIVE_WORLD_SIZE=2 COLLECTIVE_CHIEF=127.0.0.1:50051 python examples/jax_sync.py

(or under torchrun / mpiexec / TF_CONFIG: the roles come from there). Each process initialises
its parameters with its own key, calls ``collective.jax.sync_pytree`` and then checks every
shard of every leaf on every local device against rank 0's values, takes a few jit-compiled
data-parallel SGD steps (batch split over the devices) and prints one line.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import xxhash  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import collective  # noqa: E402
import collective.jax  # noqa: E402


def init_params(key: jax.Array, dtype) -> dict:
    k1, k2 = jax.random.split(key)
    return {
        "dense": {"kernel": jax.random.normal(k1, (8, 16), dtype), "bias": jnp.zeros(16, dtype)},
        "out": {"kernel": jax.random.normal(k2, (16, 1), dtype), "bias": jnp.zeros(1, dtype)},
        "step": jnp.array(0, jnp.int32),
    }


def tree_digest(tree) -> str:
    h = xxhash.xxh3_128()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()


def loss(params, x, y):
    h = jax.nn.relu(x @ params["dense"]["kernel"] + params["dense"]["bias"])
    return jnp.mean((h @ params["out"]["kernel"] + params["out"]["bias"] - y) ** 2)


def main() -> int:
    dtype = getattr(jnp, os.environ.get("JAX_SYNC_DTYPE", "float32"))
    seed = int(os.environ.get("COLLECTIVE_RANK") or os.environ.get("RANK") or 0)
    params = init_params(jax.random.key(100 + seed), dtype)
    own = tree_digest(params)
    try:
        synced = collective.jax.sync_pytree(params)
    except collective.CollectiveError as exc:
        print(f"rank {seed}: error: {exc}", flush=True)
        return exc.exit_code
    devices = jax.local_devices()
    # Every shard on every device: the same bytes (the digest of shard 0 is rank 0's tree).
    per_device = [
        tree_digest(jax.tree_util.tree_map(lambda a, i=i: a.addressable_shards[i].data, synced)) for i in range(len(devices))
    ]
    assert all(s.data.device == d for s, d in zip(synced["dense"]["kernel"].addressable_shards, devices, strict=True))

    # A few data-parallel steps: the batch split over the local devices (jit + shardings), the
    # parameters replicated, so the gradient is the mean over every device's part of the batch.
    mesh = synced["dense"]["kernel"].sharding.mesh
    batch = NamedSharding(mesh, PartitionSpec("replica"))

    @jax.jit
    def step(p, x, y):
        weights = {k: p[k] for k in ("dense", "out")}
        g = jax.grad(loss)(weights, x, y)
        return {**jax.tree_util.tree_map(lambda a, b: a - 0.01 * b, weights, g), "step": p["step"] + 1}

    params = synced
    rng = np.random.default_rng(seed)
    for _ in range(3):
        x = jax.device_put(jnp.asarray(rng.standard_normal((16 * len(devices), 8)), dtype), batch)
        params = step(params, x, x.sum(axis=-1, keepdims=True))
    final = {
        tree_digest(jax.tree_util.tree_map(lambda a, i=i: a.addressable_shards[i].data, params)) for i in range(len(devices))
    }
    print(
        f"rank {seed}: own init {own[:12]} -> synced {per_device[0][:12]} on {len(devices)} devices "
        f"(all shards equal: {len(set(per_device)) == 1}); 3 jit steps, replicas equal after: {len(final) == 1}",
        flush=True,
    )
    return 0 if len(set(per_device)) == 1 and len(final) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
