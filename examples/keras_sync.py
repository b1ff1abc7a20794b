"""Keras under tf.distribute.MirroredStrategy: every process starts from rank 0's variables, one
replica per local device (``name``, ``name/replica_1``).

Two processes with two logical CPU devices each, on one machine::

    COLLECTIVE_RANK=0 COLLECTIVE_WORLD_SIZE=2 COLLECTIVE_CHIEF=127.0.0.1:50051 python examples/keras_sync.py &
    COLLECTIVE_RANK=1 COLLECTIVE_WORLD_SIZE=2 COLLECTIVE_CHIEF=127.0.0.1:50051 python examples/keras_sync.py

Each process builds the model with its own seed, calls ``collective.tf.sync_keras``, checks
that every replica on every device holds the same bytes, trains a few steps with ``fit`` and
prints one line. ``KERAS_SYNC_DTYPE=bfloat16`` builds the model in bfloat16;
``KERAS_SYNC_MISMATCH_RANK=r`` gives rank r a hidden layer of 15 units (every rank then fails,
listing the differences, before any byte moves).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import xxhash  # noqa: E402

import collective  # noqa: E402
import collective.tf  # noqa: E402

LOCAL_DEVICES = 2


def replica_digest(model, i: int) -> tuple[str, list[str]]:
    """Digest of replica i of every variable, and the replicas' TensorFlow names."""
    h, names = xxhash.xxh3_128(), []
    for v in model.variables:
        c = collective.tf.components(v)[i]
        names.append(c.name)
        h.update(collective.tf.variable_name(v).encode())
        h.update(np.ascontiguousarray(c.numpy()).tobytes())
    return h.hexdigest(), names


def main() -> int:
    import keras

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * LOCAL_DEVICES)
    strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])
    seed = int(os.environ.get("COLLECTIVE_RANK") or os.environ.get("RANK") or 0)
    dtype = os.environ.get("KERAS_SYNC_DTYPE", "float32")
    keras.utils.set_random_seed(100 + seed)
    units = 15 if str(seed) == os.environ.get("KERAS_SYNC_MISMATCH_RANK") else 16
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(units, activation="relu", dtype=dtype, name="hidden"),
            keras.layers.Dense(1, dtype=dtype, name="out"),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    own, _ = replica_digest(model, 0)
    try:
        collective.tf.sync_keras(model, strategy)
    except collective.CollectiveError as exc:
        print(f"rank {seed}: error: {exc}", flush=True)
        return exc.exit_code
    synced = [replica_digest(model, i) for i in range(LOCAL_DEVICES)]
    digests = {d for d, _ in synced}
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    model.fit(x, x.sum(axis=1, keepdims=True), batch_size=16, epochs=1, verbose=0)
    after = {replica_digest(model, i)[0] for i in range(LOCAL_DEVICES)}
    print(
        f"rank {seed}: own init {own[:12]} -> synced {synced[0][0][:12]} on {LOCAL_DEVICES} devices "
        f"(all replicas equal: {len(digests) == 1}; {synced[0][1][0]} / {synced[1][1][0]}); "
        f"fit 4 steps, replicas equal after: {len(after) == 1}",
        flush=True,
    )
    return 0 if len(digests) == 1 and len(after) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
