"""Every transport, named once with what it provides; the API, launch and the MPI runner look
them up here instead of naming a backend's classes themselves.

A transport is a module and one ``register`` call (at the end of this file). What it provides is
given as ``"module:attribute"`` references, imported on first ``load`` only, so ``import
collective`` stays cheap and mpi4py (which starts MPI when imported) loads only for an MPI round:

- ``endpoint``: a ``ChiefEndpoint`` class, what serves a ``ChiefHandler`` (a chief, a relay, a
  holder), made as ``endpoint(bind, token=, tls=)``;
- ``link``: a ``ChiefLink`` class, a worker's calls to its chief;
- ``driver``: what drives a chief's round in step with its workers instead of serving it (MPI's
  collectives);
- ``launch``: how ``collective launch`` runs a round over it: ``"processes"`` (one chief process,
  ``python -m collective.chief``, and one per worker, ``python -m collective.worker``, finding it
  by address) or ``"mpiexec"`` (one MPI job of ``python -m collective.mpi``); None: launch does
  not offer it (in-memory: one process, for tests);
- ``heartbeats``: whether its workers send heartbeats (an MPI job ends when a rank dies);
- ``idle``: launch's options that do nothing over it, each with why (said at start, not refused).

The same-host path (``shm``: a sealed memfd or the model's files, passed as descriptors) and the
raw data port (``rawtcp``) are not transports of their own: they carry a gRPC round's bytes
beside it, and its endpoint and link start them.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping

from collective.errors import UsageError

# What a transport may provide (``lookup(provides=)``); all but ``launch`` are classes (``load``).
PARTS = ("endpoint", "link", "driver", "launch")
# Launch's options a registration may call idle (launch says so when one is given).
IDLE_OPTIONS = ("topology", "no-shm", "token", "heartbeats")
# The transport of a round whose processes find each other by address: ``serve`` / ``join`` /
# ``sync`` outside mpiexec, and the chief and worker commands.
NETWORK = "grpc"


@dataclasses.dataclass(frozen=True)
class Transport:
    name: str
    about: str
    endpoint: str | None = None
    link: str | None = None
    driver: str | None = None
    launch: str | None = None
    heartbeats: bool = True
    idle: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def load(self, part: str):
        """The class (or function) this transport provides as ``part``, imported now."""
        if part not in PARTS or part == "launch":
            raise ValueError(f"{part!r} is not a class a transport provides: endpoint, link or driver")
        ref = getattr(self, part)
        if ref is None:
            raise UsageError(f"transport {self.name!r} provides no {part}; "
                             f"{_one_of(names(part), 'those that do are')}")
        module, _, attribute = ref.partition(":")
        return getattr(importlib.import_module(module), attribute)


_TRANSPORTS: dict[str, Transport] = {}


def register(transport: Transport) -> Transport:
    """Add a transport (a name taken is refused: unregister it first). Returns it."""
    if transport.name in _TRANSPORTS:
        raise ValueError(f"transport {transport.name!r} is registered already")
    if transport.launch not in (None, "processes", "mpiexec"):
        raise ValueError(f"transport {transport.name!r}: launch {transport.launch!r} is not processes or mpiexec")
    if unknown := sorted(set(transport.idle) - set(IDLE_OPTIONS)):
        raise ValueError(f"transport {transport.name!r}: idle {unknown} are not among {', '.join(IDLE_OPTIONS)}")
    _TRANSPORTS[transport.name] = transport
    return transport


def unregister(name: str) -> None:
    _TRANSPORTS.pop(name, None)


def names(provides: str | None = None) -> list[str]:
    """The registered transports' names, sorted; with ``provides``, only those that have it."""
    return sorted(n for n, t in _TRANSPORTS.items() if provides is None or getattr(t, provides) is not None)


def lookup(name: str, provides: str | None = None, *, what: str = "transport") -> Transport:
    """The transport called ``name``; with ``provides`` (one of ``PARTS``), it must have that part.
    Anything else is refused with one line naming the ones that would do (``what``: how the
    caller's user named it, e.g. ``--transport``)."""
    if provides not in (None, *PARTS):
        raise ValueError(f"{provides!r} is not a part a transport provides: {', '.join(PARTS)}")
    transport = _TRANSPORTS.get(name) if isinstance(name, str) else None
    if transport is None or (provides is not None and getattr(transport, provides) is None):
        raise UsageError(f"{what} {name!r} {_one_of(names(provides))}")
    return transport


def _one_of(known: list[str], lead: str = "is not one of") -> str:
    return f"{lead} {', '.join(known)}" if known else f"{lead}: none registered"


register(Transport(
    "grpc", "gRPC between processes (a raw TCP or unix socket for the data, shared memory on one host)",
    endpoint="collective.transport.grpc:GrpcEndpoint", link="collective.transport.grpc:GrpcChiefLink",
    launch="processes",
))
register(Transport(
    "mpi", "an MPI job: rank 0 the chief, ranks 1..N the workers, in step through MPI's collectives",
    link="collective.transport.mpi:MpiChiefLink", driver="collective.transport.mpi:MpiChiefDriver",
    launch="mpiexec", heartbeats=False, idle={
        "topology": "rank 0 sends each rank its stream (a star, over MPI)",
        "no-shm": "MPI moves the bytes, by its own means on one host",
        "token": "no network service is started to present it to",
        "heartbeats": "the MPI job has no heartbeats (mpiexec ends it when a rank dies)",
    },
))
register(Transport(
    "inmemory", "the whole cluster in one process, messages through protobuf (unit tests)",
    endpoint="collective.transport.inmemory:InMemoryEndpoint", link="collective.transport.inmemory:InMemoryLink",
))
