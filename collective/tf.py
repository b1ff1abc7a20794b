"""TensorFlow / Keras hand-off: inside a ``tf.distribute.MirroredStrategy``, a model's variables
take rank 0's values, by name, one replica per device.

::

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])   # or the GPUs
    with strategy.scope():
        model = build_model()
    collective.tf.sync_keras(model, strategy)

Each variable is named by its Keras path (``sequential/dense/kernel``; a plain ``tf.Variable``
by its name without ``:0``), and its per-device components are the mirrored replicas TensorFlow
names ``name`` and ``name/replica_1``... (as the seed's ``_real_mirrored_creator`` does): the
component on the strategy's device i is assigned the verified replica i and read back and
checked against its digest. The names, shapes and dtypes are this process's declaration: a
process whose model differs fails with every difference listed before any byte moves.
bfloat16 variables travel as ``ml_dtypes`` arrays (TensorFlow's own numpy type for them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

import collective
from collective.digest import array_digest
from collective.errors import IntegrityError, UsageError

__all__ = ["sync_keras", "sync_variables", "device_name", "components", "variable_name"]

_DEVICE = re.compile(r"(?:^|/)device:(?P<kind>[A-Za-z_]+):(?P<index>\d+)$")
_KINDS = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}


def device_name(tf_device: str) -> str:
    """``/job:localhost/replica:0/task:0/device:GPU:1`` -> ``cuda:1`` (``CPU:i`` -> ``cpu:i``)."""
    m = _DEVICE.search(tf_device)
    if not m:
        raise UsageError(f"cannot tell the device of {tf_device!r}")
    kind = m["kind"].lower()
    return f"{_KINDS.get(kind, kind)}:{m['index']}"


def _tf_variable(v: Any):
    """The TensorFlow variable behind a Keras 3 variable (or ``v`` itself)."""
    inner = getattr(v, "value", None) if not isinstance(v, tf.Variable) else None
    return inner if isinstance(inner, tf.Variable) else v


def components(v: Any) -> list:
    """The per-device variables of ``v``: a mirrored variable's replicas, else ``[v]``."""
    tv = _tf_variable(v)
    values = getattr(tv, "values", None)
    return list(values) if values is not None else [tv]


def variable_name(v: Any) -> str:
    """The Keras path, else the TensorFlow name without its ``:0``."""
    path = getattr(v, "path", None)
    if isinstance(path, str) and path:
        return path
    name = _tf_variable(v).name
    return name[: -len(":0")] if name.endswith(":0") else name


def sync_variables(variables: Iterable[Any], devices: Sequence[str], **sync_kwargs: Any) -> collective.SyncResult:
    """``collective.sync`` of these variables (values from their first component) over the
    strategy's ``devices`` (TensorFlow device strings), then every component assigned the
    replica of its device, read back and checked."""
    variables = list(variables)
    names = [device_name(d) for d in devices]
    values: dict[str, np.ndarray] = {}
    for v in variables:
        name = variable_name(v)
        if name in values:
            raise UsageError(f"two variables are named {name!r}: give the layers distinct names")
        values[name] = np.asarray(components(v)[0].numpy())
    result = collective.sync(values, devices=names, **sync_kwargs)
    per_device = [result.arrays(i) for i in range(len(names))]
    for v in variables:
        name = variable_name(v)
        for c in components(v):
            i = names.index(device_name(c.device)) if len(names) > 1 else 0
            want = per_device[i][name]
            c.assign(want)
            if array_digest(np.asarray(c.numpy())) != array_digest(want):
                raise IntegrityError(f"{c.name}: the copy on {c.device} differs from the verified value")
    return result


def sync_keras(model: Any, strategy: tf.distribute.Strategy | None = None, **sync_kwargs: Any) -> collective.SyncResult:
    """Every variable of ``model`` (built under ``strategy.scope()``) takes rank 0's value on
    each of the strategy's devices. Every process calls it; keyword arguments go to
    ``collective.sync``. Returns the ``SyncResult``."""
    strategy = strategy if strategy is not None else tf.distribute.get_strategy()
    devices = list(strategy.extended.worker_devices)
    return sync_variables(model.variables, devices, **sync_kwargs)
