"""Each interface says what its implementers do, and no module reaches into another's object.

* A relay and a publication implement only the part of ``ChiefHandler`` they serve
  (``StreamSource``, ``PlanSource``); their server refuses the rest in their words
  (``transport.api.stream_server`` / ``plan_server``), and the chief implements all of it.
* Every receiver a link writes into is a ``StreamSink``.
* No module of ``collective/`` reads a private attribute (``x._name``) of an object that is not
  its own (``self``, ``cls``), unless the module itself defines that name: the round's state is
  one public object (``chief/state.py``), not the service's privates read from three files.
"""

from __future__ import annotations

import ast
import collections
import typing
from pathlib import Path

import numpy as np
import pytest

from collective import errors as E
from collective._proto import collective_pb2 as pb
from collective.chief.service import ChiefService
from collective.snapshot.holder import SnapshotHandler, build
from collective.stream import Part, Receiver
from collective.transport import api
from collective.worker.agent import _Watched
from collective.worker.relay import RelayHandler

PACKAGE = Path(api.__file__).resolve().parents[1]


def members(protocol: type) -> set[str]:
    """The names a Protocol (and the Protocols it extends) declares: methods and attributes."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (typing.Protocol, typing.Generic, object):
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")}
        names |= set(getattr(cls, "__annotations__", {}))
    return names


ROUND = members(api.RoundHandler)
STREAM = members(api.StreamSource)
PLANS = members(api.PlanSource) - STREAM


def test_chief_handler_is_the_stream_source_and_the_round_apart():
    assert members(api.ChiefHandler) == STREAM | PLANS | ROUND
    assert not ROUND & (STREAM | PLANS)
    assert {"join", "await_prepared", "report_ready", "await_start", "heartbeat"} <= ROUND
    assert {"fetch", "stream_views", "lost"} <= STREAM and PLANS == {"get_plan", "status"}


@pytest.mark.parametrize(("cls", "serves"), [(RelayHandler, STREAM), (SnapshotHandler, STREAM | PLANS)])
def test_a_relay_and_a_publication_implement_only_what_they_serve(cls, serves):
    assert all(hasattr(cls, name) for name in serves - {"num_workers"}), serves
    assert not [name for name in members(api.ChiefHandler) - serves if hasattr(cls, name)]


def test_the_chief_implements_the_whole_handler():
    missing = [n for n in members(api.ChiefHandler) - {"refusal", "num_workers"} if not hasattr(ChiefService, n)]
    assert not missing


def test_a_relays_server_refuses_every_other_call_in_its_words():
    served = api.stream_server(RelayHandler(stall_timeout=1.0))
    ref = pb.WorkerRef(worker_id="w0")
    for name, args in [("join", (pb.JoinRequest(), "peer")), ("get_plan", (ref, 1.0)), ("status", ()),
                       ("ready_bytes", (ref,)), ("heartbeat", (pb.HeartbeatRequest(),)), ("await_outcome", (ref, 1.0))]:
        with pytest.raises(E.UnimplementedError, match="worker's relay: it serves only the data stream"):
            getattr(served, name)(*args)
    assert served.specs == []


def test_a_publications_server_gives_its_plan_and_status_and_refuses_a_round():
    plan, arena, _keep = build({"w": np.arange(4, dtype=np.float32)}, 3, copy=False, chunk_bytes=1 << 20, name="")
    holder = SnapshotHandler(plan, arena)
    served = api.plan_server(holder)
    assert served.get_plan(pb.WorkerRef(worker_id="f"), 1.0) is plan
    assert served.status().phase == "publishing"
    assert len(served.specs) == len(plan.variables) and served.num_workers == holder.num_workers
    with pytest.raises(E.UnimplementedError, match="publication .* not a round"):
        served.await_start(pb.WorkerRef(worker_id="f"), 1.0)


@pytest.mark.parametrize("cls", [Receiver, Part, _Watched])
def test_every_receiver_a_link_writes_into_is_a_stream_sink(cls):
    missing = [n for n in members(api.StreamSink) if not hasattr(cls, n) and n != "plan"]
    assert not missing
    if cls is not Receiver:  # a Receiver's plan is set in __init__
        assert hasattr(cls, "plan")


# --- private attributes -----------------------------------------------------------------------

# (module, attribute): reads allowed, each for a reason.
ALLOWED = {
    # The standard library's: os._exit is its documented way out without cleanup; argparse has no
    # public name for the subparsers action (config.Parser finds its subcommand through it).
    ("collective/mpi.py", "_exit"),
    ("collective/transport/mpi.py", "_exit"),
    ("collective/config.py", "_SubParsersAction"),
    # The agent's own method, from ChiefWatch (worker/heartbeat.py) that WorkerAgent mixes in,
    # called by the agent module's stream helper (_Watched) on its agent.
    ("collective/worker/agent.py", "_report_failure"),
}


def private_reads(root: Path) -> collections.Counter:
    """(module, expression, attribute) -> count, for each ``x._name`` in ``root``'s modules where
    ``x`` is not ``self``/``cls`` and the module defines no ``_name`` of its own (a function, a
    class, a name, or an attribute of ``self``/``cls``). Dunders and the generated protobuf
    modules are left out."""
    found: collections.Counter = collections.Counter()
    for path in sorted(root.rglob("*.py")):
        if "_proto" in path.parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        own = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                own.add(node.attr)
        module = path.relative_to(root.parent).as_posix()
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.endswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr not in own:
                found[(module, ast.unparse(node.value), node.attr)] += 1
    return found


def test_no_module_reads_another_objects_private_attributes():
    reads = private_reads(PACKAGE)
    bad = sorted(f"{module}: {expr}.{attr} ({n}x)" for (module, expr, attr), n in reads.items()
                 if (module, attr) not in ALLOWED)
    assert not bad, "read a public name (or pass the object, e.g. chief/state.RoundState) instead:\n" + "\n".join(bad)


def test_the_private_read_finder_finds_one(tmp_path):
    """The check above would fail on the old chief: ``svc._members`` read from another module."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "service.py").write_text("class S:\n    def __init__(self):\n        self._members = {}\n")
    (pkg / "supervise.py").write_text("def run(svc, self):\n    self._x = 1\n    return svc._members, self._x, svc.__dict__\n")
    assert private_reads(pkg) == {("pkg/supervise.py", "svc", "_members"): 1}
