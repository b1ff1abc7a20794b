"""collective: broadcast a model's initial variables from a chief to every worker, verified bit
for bit, before data-parallel training starts.

The Python API (every call reads the same environment as the command line: ``COLLECTIVE_*``,
``TF_CONFIG``, torchrun's variables; an explicit argument wins)::

    import collective
    result = collective.sync(model_arrays)       # every rank calls it; rank 0's values win
    weights = result.arrays(0)                   # name -> rank 0's array, on this process's device 0

* ``sync``  - SPMD: every training process calls it; rank 0 serves its values and trains too.
* ``serve`` - be the chief in this process (as ``python -m collective.chief``).
* ``join``  - be a worker in this process (as ``python -m collective.worker``).
* ``check`` - after start, at any step: do all ranks still hold the same values? (a digest
  per rank is exchanged, not the values; ``DivergenceError`` on every rank names who differs)
* ``create_variable`` / ``Synchronization`` / ``Aggregation`` / ``VariableSpec`` - variables
  with TensorFlow's semantics.
* ``load_model`` - a preset, spec, ``.npz`` or ``.safetensors`` file as a model source.
* ``publish`` / ``fetch`` - serve a training state at a step; fetch it from one or several
  holders, striped and verified chunk by chunk (``Publication``, ``FetchError``).
* ``subscribe`` - follow a publication step by step (``Publication.update``): each step's
  element-level delta applied in place and verified (``Subscription``).
* ``local_rank`` - this process's index on its host (torchrun, mpirun, srun, ``COLLECTIVE_*``).
* ``Timeouts``, ``TlsFiles`` - settings; ``CollectiveError`` and its subclasses - the errors.

``import collective`` is cheap: the transports (gRPC, MPI) load on first use.
"""

# ruff: noqa: E402 - the SIGINT hold must come before the other imports
from __future__ import annotations

# First, before the imports below (numpy among them): `python -m collective.<command>` holds a
# Ctrl-C from here until its entry point acts on it (entry.hold_sigint_while_starting).
from collective.entry import hold_sigint_while_starting

hold_sigint_while_starting()

from typing import TYPE_CHECKING, Any

from collective.clusterenv import local_rank
from collective.config import Timeouts
from collective.errors import (
    AbortedError,
    AlreadyExistsError,
    AuthError,
    ChiefUnreachableError,
    CollectiveError,
    DeadlineError,
    DivergenceError,
    FetchError,
    FrozenError,
    IntegrityError,
    InvalidVariableError,
    JoinTimeoutError,
    ModelError,
    PermissionDeniedError,
    PreconditionError,
    ProtocolError,
    RelayError,
    ResourceExhaustedError,
    TransportError,
    UsageError,
)
from collective.model import Aggregation, Synchronization, VariableSpec
from collective.variables import create_variable

if TYPE_CHECKING:
    from collective._api import join, serve, sync
    from collective.checks import check
    from collective.replicas import SyncResult
    from collective.snapshot import Publication, Subscription, fetch, publish, subscribe
    from collective.sources import load_source as load_model
    from collective.transport.grpc import TlsFiles

__all__ = [
    "sync",
    "serve",
    "join",
    "check",
    "SyncResult",
    "load_model",
    "local_rank",
    "create_variable",
    "Synchronization",
    "Aggregation",
    "VariableSpec",
    "Timeouts",
    "TlsFiles",
    "CollectiveError",
    "UsageError",
    "ModelError",
    "InvalidVariableError",
    "FrozenError",
    "TransportError",
    "ChiefUnreachableError",
    "RelayError",
    "AuthError",
    "PermissionDeniedError",
    "ProtocolError",
    "IntegrityError",
    "JoinTimeoutError",
    "DeadlineError",
    "DivergenceError",
    "AbortedError",
    "AlreadyExistsError",
    "PreconditionError",
    "ResourceExhaustedError",
    "publish",
    "fetch",
    "Publication",
    "subscribe",
    "Subscription",
    "FetchError",
]

# Loaded on first use: each pulls in numpy-heavy or transport modules (grpc) that a plain
# ``import collective`` should not pay for.
_LAZY = {
    "sync": ("collective._api", "sync"),
    "serve": ("collective._api", "serve"),
    "join": ("collective._api", "join"),
    "check": ("collective.checks", "check"),
    "SyncResult": ("collective.replicas", "SyncResult"),
    "load_model": ("collective.sources", "load_source"),
    "TlsFiles": ("collective.transport.grpc", "TlsFiles"),
    "publish": ("collective.snapshot", "publish"),
    "fetch": ("collective.snapshot", "fetch"),
    "Publication": ("collective.snapshot", "Publication"),
    "subscribe": ("collective.snapshot", "subscribe"),
    "Subscription": ("collective.snapshot", "Subscription"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'collective' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
