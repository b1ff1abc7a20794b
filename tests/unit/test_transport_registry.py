"""The transport registry: one registration makes a transport what the API, launch and the MPI
runner find; an unknown name is refused in one line naming the known ones; and none of the three
names a backend's classes itself (a check that fails if the wiring spreads out again)."""

from __future__ import annotations

import ast

import pytest

from collective.config import Timeouts
from collective.errors import UsageError
from collective.transport import registry
from collective.transport.registry import Transport, lookup, names, register, unregister
from tests.procs import ROOT


class Reached(Exception):
    """What a fake's class raises when it is made: who made it, with what."""


class FakeEndpoint:
    def __init__(self, bind, *, token=None, tls=None):
        raise Reached("endpoint", bind)


class FakeLink:
    def __init__(self, *args, **kwargs):
        raise Reached("link", args)


class FakeDriver:
    pass


@pytest.fixture
def fake():
    transport = register(Transport(
        "fake", "a test's", endpoint=f"{__name__}:FakeEndpoint", link=f"{__name__}:FakeLink", launch="processes",
        idle={"token": "the fake has no token"},
    ))
    yield transport
    unregister("fake")


def test_a_transport_registered_here_is_found_by_the_lookups(fake, tmp_path):
    assert lookup("fake") is fake and lookup("fake", "endpoint") is fake
    assert fake.load("endpoint") is FakeEndpoint and fake.load("link") is FakeLink
    assert "fake" in names() and "fake" in names("launch") and "fake" not in names("driver")


def test_launch_takes_a_registered_transport_and_its_idle_options(fake, tmp_path):
    from collective.cli.launch import Launcher

    launcher = Launcher(workers=1, run_dir=str(tmp_path / "run"), transport="fake", token="t", topology="star")
    assert launcher.transport == "fake"
    # Only what the registration calls idle is said (the topology is not, here).
    assert launcher.warnings == ["--token does nothing under --transport fake: the fake has no token"]


def test_serve_and_join_make_the_network_transports_endpoint_and_link(fake, monkeypatch):
    from collective import _api

    monkeypatch.setattr(registry, "NETWORK", "fake")
    with pytest.raises(Reached) as made:
        _api.run_chief(lambda: None, 1, bind="127.0.0.1:0", token=None, tls=None, timeouts=Timeouts())
    assert made.value.args == ("endpoint", "127.0.0.1:0")
    with pytest.raises(Reached) as made:
        _api.join("127.0.0.1:9", devices="cpu:0", relay_host=None, timeouts=Timeouts())
    assert made.value.args == ("link", ("127.0.0.1:9",))


def test_the_mpi_runner_makes_the_mpi_transports_link_and_driver(monkeypatch):
    from collective import mpi

    monkeypatch.setitem(registry._TRANSPORTS, "mpi", Transport(
        "mpi", "a test's stand-in", link=f"{__name__}:FakeLink", driver=f"{__name__}:FakeDriver", launch="mpiexec"))

    class Watchdog:
        def phase(self, name, timeout):
            pass

    with pytest.raises(Reached) as made:
        mpi.run_worker_rank("comm", Watchdog(), Timeouts(), ["cpu:0"])
    what, args = made.value.args
    assert what == "link" and args[0] == "comm"


def test_an_unknown_name_is_refused_in_one_line_naming_the_known_ones():
    with pytest.raises(UsageError) as err:
        lookup("pigeon")
    assert str(err.value) == "transport 'pigeon' is not one of grpc, inmemory, mpi"
    # What launch offers: those that say how launch runs them.
    for name in ("pigeon", "inmemory"):
        with pytest.raises(UsageError) as err:
            lookup(name, "launch", what="--transport")
        assert str(err.value) == f"--transport {name!r} is not one of grpc, mpi"
    from collective.cli.launch import Launcher

    with pytest.raises(UsageError, match=r"^--transport 'pigeon' is not one of grpc, mpi$"):
        Launcher(workers=1, transport="pigeon")
    with pytest.raises(UsageError) as err:
        lookup("mpi").load("endpoint")
    assert str(err.value) == "transport 'mpi' provides no endpoint; those that do are grpc, inmemory"


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="'grpc' is registered already"):
        register(Transport("grpc", "a second gRPC"))
    with pytest.raises(ValueError, match="launch 'ssh' is not processes or mpiexec"):
        register(Transport("other", "a new one", launch="ssh"))
    with pytest.raises(ValueError, match=r"idle \['seed'\] are not among topology, no-shm, token, heartbeats"):
        register(Transport("other", "a new one", idle={"seed": "no seeds"}))
    assert "other" not in names()


def test_the_runners_name_no_transports_class_themselves():
    # The parts the registry names (GrpcEndpoint, MpiChiefLink, ...) are loaded through it: a
    # module here importing one by name is wiring in a second place.
    parts = {getattr(t, p).partition(":")[2] for t in registry._TRANSPORTS.values()
             for p in ("endpoint", "link", "driver") if getattr(t, p)}
    assert {"GrpcEndpoint", "GrpcChiefLink", "MpiChiefLink", "MpiChiefDriver"} <= parts
    found = []
    for module in ("_api.py", "cli/launch.py", "mpi.py"):
        tree = ast.parse((ROOT / "collective" / module).read_text())
        found += [f"collective/{module}:{node.lineno}: imports {a.name}" for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) for a in node.names if a.name in parts]
    assert found == [], "\n".join(found)


def test_launch_says_each_option_a_registration_may_call_idle(tmp_path):
    import dataclasses

    from collective.cli.launch import Launcher

    register(Transport("idler", "a test's", launch="processes", idle={o: "why" for o in registry.IDLE_OPTIONS}))
    try:
        timeouts = dataclasses.replace(Timeouts(), heartbeat=Timeouts().heartbeat + 1)
        launcher = Launcher(workers=1, run_dir=str(tmp_path / "run"), transport="idler", token="t", topology="star",
                            shm=False, timeouts=timeouts)
    finally:
        unregister("idler")
    assert launcher.warnings == [f"{given} nothing under --transport idler: why" for given in (
        "--topology star does", "--no-shm does", "--token does", "--heartbeat-interval / --heartbeat-timeout do")]
