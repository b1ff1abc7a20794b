"""JAX hand-off: a pytree of rank 0's values on every process, one copy per local device.

::

    import collective.jax
    params = init(jax.random.key(seed_of_this_process), ...)
    params = collective.jax.sync_pytree(params)   # rank 0's values, replicated on jax.local_devices()

Leaves are named by their pytree path (``['dense']['kernel']``); the names, shapes and dtypes
are this process's declaration, so a process whose tree differs fails with every difference
listed before any byte moves. Each returned leaf is one ``jax.Array`` replicated over the local
devices (``NamedSharding`` over a 1-D mesh, ``PartitionSpec()``): shard i is a copy of the
verified replica i, placed on device i and read back and checked against its digest.
bfloat16 and float8 leaves travel as their ``ml_dtypes`` types, bit for bit.

Roles come from ``collective.sync``'s sources (arguments, ``COLLECTIVE_*``, ``TF_CONFIG``,
torchrun, MPI); the processes need no ``jax.distributed`` set-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import collective
from collective.digest import array_digest
from collective.errors import IntegrityError, UsageError

__all__ = ["sync_pytree", "device_name", "leaf_arrays", "replicate"]

_PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "tpu": "tpu", "METAL": "mps"}


def device_name(device: jax.Device) -> str:
    """The collective name of a JAX device: ``cpu:0``, ``cuda:1``..."""
    return f"{_PLATFORMS.get(device.platform, device.platform)}:{device.id}"


def leaf_arrays(tree: Any) -> tuple[dict[str, np.ndarray], Any]:
    """The tree's leaves as numpy arrays named by their paths, in flatten order, and the treedef."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    named = {}
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path) or "<root>"
        named[name] = np.asarray(leaf)
    return named, treedef


def replicate(replicas: Sequence[np.ndarray], devices: Sequence[jax.Device], *, name: str = "") -> jax.Array:
    """One ``jax.Array`` replicated over ``devices``: shard i is ``replicas[i]`` copied to
    ``devices[i]``, read back and checked."""
    shards = []
    for a, device in zip(replicas, devices, strict=True):
        shard = jax.device_put(a, device)
        if array_digest(np.asarray(shard)) != array_digest(a):
            raise IntegrityError(f"{name}: the copy on {device_name(device)} differs from the verified value")
        shards.append(shard)
    mesh = Mesh(np.array(list(devices)), ("replica",))
    return jax.make_array_from_single_device_arrays(replicas[0].shape, NamedSharding(mesh, PartitionSpec()), shards)


def sync_pytree(tree: Any, *, devices: Sequence[jax.Device] | None = None, **sync_kwargs: Any) -> Any:
    """Rank 0's ``tree`` on every process, each leaf replicated on ``devices`` (default
    ``jax.local_devices()``). Every process calls it; keyword arguments go to ``collective.sync``.
    """
    local = list(devices) if devices is not None else jax.local_devices()
    if not local:
        raise UsageError("no local JAX devices")
    names = [device_name(d) for d in local]
    values, treedef = leaf_arrays(tree)
    result = collective.sync(values, devices=names, **sync_kwargs)
    per_device = [result.arrays(i) for i in range(len(local))]
    leaves = [replicate([arrays[name] for arrays in per_device], local, name=name) for name in values]
    return jax.tree_util.tree_unflatten(treedef, leaves)
