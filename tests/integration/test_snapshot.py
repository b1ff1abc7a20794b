"""collective.publish / collective.fetch between real processes over gRPC on 127.0.0.1: a holder
process (tests/snapshot_holder.py) publishes, this process fetches. Bit-identical states (digests
compared), striping over several holders, a holder killed mid-fetch, and hostile holders: bytes
that differ from their own plan, wrong step, bad token, disagreeing manifests, a pickle where
JSON belongs."""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

import collective
from collective.digest import array_digest
from collective.snapshot import tree
from tests.clusters import TOKEN
from tests.procs import Proc, wait_for_file

pytestmark = pytest.mark.integration


@pytest.fixture
def holders(tmp_path):
    """start(*args) -> (address, digests file contents) of a new holder process; all killed by pid."""
    started: list[Proc] = []

    def start(*args: str, token: str = TOKEN) -> tuple[str, dict, Proc]:
        folder = tmp_path / f"holder{len(started)}"
        folder.mkdir()
        addr_file = folder / "address"
        proc = Proc(["-m", "tests.snapshot_holder", "--address-file", str(addr_file), *args],
                    folder / "log", env={"COLLECTIVE_TOKEN": token})
        started.append(proc)
        address = wait_for_file(addr_file, proc, timeout=60)
        return address, json.loads((folder / "state_digests.json").read_text()), proc

    yield start
    for proc in started:
        proc.kill()


def _same(fetched, published: dict) -> None:
    """Every tensor of ``fetched`` has the digest the holder computed of its own tensor."""
    _, arrays = tree.flatten(fetched)
    assert {n: array_digest(a) for n, a in arrays.items()} == published["digests"]
    assert fetched.manifest_digest == published["manifest"]


def test_nested_state_arrives_bit_identical_with_its_json_leaves(holders):
    address, published, _ = holders("--state", "nested")
    got = collective.fetch(address, step=8, token=TOKEN, timeout=60)
    _same(got, published)
    assert got["meta"] == {"lr": 0.001, "betas": (0.9, 0.999), "name": "run-7", "done": False, "none": None,
                           3: ["a", 1, 2.5]}  # an int key stays an int, a tuple a tuple
    assert got["layer.0.weight"].dtype == np.float32 and got["layer.0.weight"].shape == (16, 8)
    assert got["empty"].shape == (0, 4) and got.step == 8


def test_torch_module_and_adam_state_load_in_place(holders):
    torch = pytest.importorskip("torch")
    import collective.torch as ct

    address, published, _ = holders("--state", "torch")
    got = collective.fetch([address], step=8, token=TOKEN, timeout=60)
    _same(got, published)
    torch.manual_seed(1)  # other values: loading must replace them
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    params = list(model.parameters())
    ct.load_state(model, opt, state=got)
    assert list(model.parameters()) == params  # the same Parameter objects, now over the fetched bytes
    w = model.state_dict()["0.weight"]
    assert w.data_ptr() == got["model"]["0.weight"].ctypes.data  # zero copy
    assert opt.param_groups[0]["lr"] == 0.001 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    state = opt.state_dict()["state"]
    assert sorted(state) == [0, 1, 2, 3]
    assert array_digest(state[0]["exp_avg"].numpy()) == published["digests"]["optimizer/state/0/exp_avg"]
    model(torch.randn(2, 8)).sum().backward()
    opt.step()  # the loaded optimizer steps


def test_striped_over_three_holders_each_serves_a_share(holders):
    started = [holders("--state", "big", "--mib", "32", "--chunk-bytes", str(1 << 20)) for _ in range(3)]
    got = collective.fetch([a for a, _, _ in started], step=8, token=TOKEN, timeout=120)
    _same(got, started[0][1])
    shares = [got.stats[a]["bytes"] for a, _, _ in started]
    assert all(s > 0 for s in shares), got.stats
    assert sum(shares) == got.total_bytes  # every byte came from exactly one holder
    assert all(s["dropped"] is None for s in got.stats.values())


def test_a_holder_killed_mid_fetch_leaves_its_share_to_the_others(holders):
    mib = ["--state", "big", "--mib", "64", "--chunk-bytes", str(1 << 20)]
    victim, published, victim_proc = holders(*mib, "--pace", "0.25")  # 6 chunks a stripe: 1.5 s each
    others = [holders(*mib)[0] for _ in range(2)]
    result: dict = {}
    fetcher = threading.Thread(target=lambda: result.update(
        got=_catch(lambda: collective.fetch([victim, *others], step=8, token=TOKEN, timeout=120, stall_timeout=10))))
    fetcher.start()
    time.sleep(1.0)  # the victim is inside its first stripe (it takes 1.5 s)
    assert fetcher.is_alive()
    victim_proc.kill()
    fetcher.join(120)
    got = result["got"]
    assert not isinstance(got, Exception), got
    _same(got, published)
    assert "was lost" in got.stats[victim]["dropped"]
    assert got.stats[victim]["bytes"] < 64 << 20


def test_the_only_holder_killed_mid_fetch_is_one_line_naming_it(holders):
    victim, _, proc = holders("--state", "big", "--mib", "16", "--chunk-bytes", str(1 << 20), "--pace", "0.2")
    threading.Timer(1.0, proc.kill).start()
    with pytest.raises(collective.FetchError) as err:
        collective.fetch(victim, step=8, token=TOKEN, timeout=60, stall_timeout=10)
    line = str(err.value)
    assert "\n" not in line and f"holder at {victim} was lost" in line and "no holder is left for bytes" in line


def test_a_holder_whose_bytes_differ_from_its_plan_is_named_with_the_variable(holders):
    address, _, _ = holders("--state", "nested", "--flip", "layer.0.bias")
    with pytest.raises(collective.IntegrityError) as err:
        collective.fetch(address, step=8, token=TOKEN, timeout=60)
    assert f"holder at {address} sent bytes of 'layer.0.bias' that differ from its own plan" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_lying_holder_among_honest_ones_is_dropped_and_its_share_retaken(holders):
    mib = ["--state", "big", "--mib", "16", "--chunk-bytes", str(1 << 20)]
    liar, _, _ = holders(*mib, "--flip", "*")  # a changed byte in every MiB it serves
    honest, published, _ = holders(*mib)
    got = collective.fetch([liar, honest], step=8, token=TOKEN, timeout=60)
    _same(got, published)
    assert "that differ from its own plan" in got.stats[liar]["dropped"]
    assert got.stats[liar]["bytes"] == 0 and got.stats[honest]["dropped"] is None


def test_wrong_step_is_one_line(holders):
    address, _, _ = holders("--state", "nested", "--step", "7")
    with pytest.raises(collective.FetchError, match=rf"^holder at {address} publishes step 7, not step 8$"):
        collective.fetch(address, step=8, token=TOKEN, timeout=60)


def test_bad_token_is_refused_naming_the_holder(holders):
    address, _, _ = holders("--state", "nested")
    with pytest.raises(collective.AuthError, match=rf"^holder at {address} refused the cluster token"):
        collective.fetch(address, step=8, token="not-the-token", timeout=60)


def test_holders_that_disagree_on_the_manifest_are_refused(holders):
    a, _, _ = holders("--state", "nested")
    b, _, _ = holders("--state", "big", "--mib", "1")
    with pytest.raises(collective.FetchError) as err:
        collective.fetch([a, b], step=8, token=TOKEN, timeout=60)
    assert "holders disagree on the manifest of step 8" in str(err.value) and a in str(err.value) and b in str(err.value)


def test_an_unreachable_holder_is_named_and_the_others_serve(holders):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nobody listens there once closed
    with pytest.raises(collective.ChiefUnreachableError, match=f"holder at {dead} unreachable"):
        collective.fetch(dead, step=8, token=TOKEN, timeout=10)
    address, published, _ = holders("--state", "nested")
    got = collective.fetch([dead, address], step=8, token=TOKEN, timeout=30)
    _same(got, published)
    assert dead not in got.stats


def test_a_pickle_where_json_belongs_is_refused_never_run(holders, tmp_path):
    canary = tmp_path / "unpickled"
    address, _, _ = holders("--state", "nested", "--pickle-tree", str(canary))
    with pytest.raises(collective.ProtocolError, match=rf"holder at {address} sent a structure that is not JSON"):
        collective.fetch(address, step=8, token=TOKEN, timeout=60)
    assert not canary.exists()


def test_a_plan_of_absurd_size_is_refused_before_allocating():
    pub = collective.publish({"x": np.arange(4.0)}, step=1, bind="127.0.0.1:0", token=TOKEN)
    try:
        pub._handler.plan.total_bytes = 1 << 60  # a hostile holder's claim
        with pytest.raises(collective.ResourceExhaustedError, match="refused before allocating"):
            collective.fetch(pub.address, step=1, token=TOKEN, timeout=30)
    finally:
        pub.close()


def test_close_stops_serving_and_is_idempotent():
    state = {"x": np.arange(1000, dtype=np.int32)}
    with collective.publish(state, step=3, bind="127.0.0.1:0", token=TOKEN, copy=True) as pub:
        state["x"][:] = 0  # copy=True: the caller may change its arrays at once
        got = collective.fetch(pub.address, step=3, token=TOKEN, timeout=30)
        assert np.array_equal(got["x"], np.arange(1000))
    pub.close()
    with pytest.raises(collective.CollectiveError, match=f"holder at {pub.address}"):
        collective.fetch(pub.address, step=3, token=TOKEN, timeout=5)


def _catch(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - handed to the test's thread
        return exc
