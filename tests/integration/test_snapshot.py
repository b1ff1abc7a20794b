"""collective.publish / collective.fetch between real processes over gRPC on 127.0.0.1: a holder
process (tests/snapshot_holder.py) publishes, this process fetches. Bit-identical states (digests
compared), striping over several holders, a holder killed mid-fetch, and hostile holders: bytes
that differ from their own plan, wrong step, bad token, disagreeing manifests, a pickle where
JSON belongs."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time

import numpy as np
import pytest

import collective
from collective.digest import array_digest
from collective.snapshot import tree
from tests.clusters import TOKEN
from tests.procs import Proc, start_holder, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def holders(tmp_path):
    """start(*args) -> (address, digests file contents, Proc) of a new holder process, named
    h0, h1, ... in order (publish(name=)); all killed by pid."""
    started: list[Proc] = []

    def start(*args: str, token: str = TOKEN) -> tuple[str, dict, Proc]:
        return start_holder(tmp_path, started, "tests.snapshot_holder", args, token)

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


def test_into_the_modules_own_tensors_no_second_copy(holders):
    torch = pytest.importorskip("torch")
    import collective.torch as ct

    a, published, _ = holders("--state", "torch", "--chunk-bytes", "256")
    b, _, _ = holders("--state", "torch", "--chunk-bytes", "256")  # two holders: stripes land in buffers of their own
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    targets = ct.receive_targets(model, prefix="model/")
    pointers = {n: t.data_ptr() for n, t in model.state_dict().items()}
    got = collective.fetch([a, b], step=8, token=TOKEN, timeout=60, into=targets)
    _same(got, published)
    assert all(got["model"][n] is targets["model/" + n] for n in pointers)  # the very arrays given
    assert {n: t.data_ptr() for n, t in model.state_dict().items()} == pointers  # written in place
    assert array_digest(model.state_dict()["2.bias"].numpy()) == published["digests"]["model/2.bias"]
    with pytest.raises(collective.UsageError, match=r"into\['model/0.weight'\] is"):
        collective.fetch(a, step=8, token=TOKEN, timeout=60, into={"model/0.weight": np.zeros(3, np.float32)})


def test_a_same_host_copy_is_mapped_not_streamed_and_outlives_its_holder(holders):
    address, published, proc = holders("--state", "big", "--mib", "8", "--copy")
    got = collective.fetch(address, step=8, token=TOKEN, timeout=60)
    assert got.stats[address]["shared_memory"] and got.stats[address]["stripes"] == 0
    proc.kill()  # the mapping is this process's own now (copy-on-write of a sealed memory file)
    _same(got, published)
    got["block.0.weight"][:] = 0  # writable, and private: nobody else sees it
    streamed = collective.fetch(holders("--state", "big", "--mib", "8", "--copy")[0], step=8, token=TOKEN,
                                timeout=60, shm=False)
    assert not any(s["shared_memory"] for s in streamed.stats.values()) and streamed.manifest_digest == published["manifest"]


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
    victim, published, victim_proc = holders(*mib, "--pace", "0.4")  # 6 chunks a stripe: 2.4 s each
    others = [holders(*mib)[0] for _ in range(2)]
    result: dict = {}
    fetcher = threading.Thread(target=lambda: result.update(
        got=_catch(lambda: collective.fetch([victim, *others], step=8, token=TOKEN, timeout=120, stall_timeout=10))))
    fetcher.start()
    wait_for(victim_proc, "streaming")  # the victim is inside its first stripe (it takes 2.4 s)
    assert fetcher.is_alive()
    victim_proc.kill()
    fetcher.join(120)
    got = result["got"]
    assert not isinstance(got, Exception), got
    _same(got, published)
    assert "was lost" in got.stats[victim]["dropped"]
    assert got.stats[victim]["bytes"] < 64 << 20


def test_a_frozen_holder_is_dropped_after_the_stall_timeout(holders):
    mib = ["--state", "big", "--mib", "32", "--chunk-bytes", str(1 << 20)]
    frozen, published, proc = holders(*mib, "--pace", "0.5")  # 4 chunks a stripe: 2 s each
    other, _, _ = holders(*mib)
    result: dict = {}
    fetcher = threading.Thread(target=lambda: result.update(
        got=_catch(lambda: collective.fetch([frozen, other], step=8, token=TOKEN, timeout=120, stall_timeout=3))))
    fetcher.start()
    try:
        wait_for(proc, "streaming")
        proc.signal(signal.SIGSTOP)  # inside its first stripe (2 s): alive, connections open, silent
        fetcher.join(120)
    finally:
        proc.signal(signal.SIGCONT)
    got = result["got"]
    assert not isinstance(got, Exception), got
    _same(got, published)
    dropped = got.stats[frozen]["dropped"]
    assert "was lost" in dropped and "3 s" in dropped, dropped


def test_the_only_holder_killed_mid_fetch_is_one_line_naming_it(holders):
    victim, _, proc = holders("--state", "big", "--mib", "16", "--chunk-bytes", str(1 << 20), "--pace", "0.2")
    result: dict = {}
    fetcher = threading.Thread(target=lambda: result.update(
        got=_catch(lambda: collective.fetch(victim, step=8, token=TOKEN, timeout=60, stall_timeout=10))))
    fetcher.start()
    wait_for(proc, "streaming")  # 16 chunks at 0.2 s: 3.2 s to go
    proc.kill()
    fetcher.join(60)
    with pytest.raises(collective.FetchError) as err:
        raise result["got"]
    line = str(err.value)
    assert "\n" not in line and f" at {victim} was lost" in line and "no holder is left for bytes" in line


def test_a_holder_whose_bytes_differ_from_its_plan_is_named_with_the_variable(holders):
    address, _, _ = holders("--state", "nested", "--flip", "layer.0.bias")
    with pytest.raises(collective.IntegrityError) as err:
        collective.fetch(address, step=8, token=TOKEN, timeout=60)
    assert f"holder h0 at {address} sent bytes of 'layer.0.bias' that differ from its own plan" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_lying_holder_among_honest_ones_is_dropped_and_its_share_retaken(holders):
    mib = ["--state", "big", "--mib", "16", "--chunk-bytes", str(1 << 20)]
    liar, _, _ = holders(*mib, "--flip", "*")  # a changed byte in every MiB it serves
    honest, published, _ = holders(*mib)
    got = collective.fetch([liar, honest], step=8, token=TOKEN, timeout=60)
    _same(got, published)
    assert "that differ from its own plan" in got.stats[liar]["dropped"]
    assert got.stats[liar]["bytes"] == 0 and got.stats[honest]["dropped"] is None


def test_into_a_stripe_inside_one_tensor_lands_in_place_and_a_liars_is_retaken(holders, monkeypatch):
    # A stripe that lies inside one tensor is received straight into the caller's array, not
    # into a buffer then copied; a liar's bytes written there are overwritten by the honest
    # holder's, and only the boundary chunks (another tensor's bytes, padding) are copied.
    from collective.snapshot import fetcher

    mib = ["--state", "big", "--mib", "16", "--chunk-bytes", str(1 << 20)]
    liar, _, _ = holders(*mib, "--flip", "*")  # a changed byte in every MiB it serves
    honest, published, _ = holders(*mib)
    into = {f"block.{i}.weight": np.zeros((16 << 20) // 4 // 8, np.float32) for i in range(8)}
    copied = []
    real = fetcher._Into.__call__

    def spy(self, buf, base, a, b):
        copied.extend(v.nbytes and (min(b, v.offset + v.nbytes) - max(a, v.offset))
                      for v in fetcher.overlapping(self.plan, a, b) if self.flat[v.name] is not buf and v.name in into)
        return real(self, buf, base, a, b)

    monkeypatch.setattr(fetcher._Into, "__call__", spy)
    got = collective.fetch([liar, honest], step=8, token=TOKEN, timeout=60, into=into)
    _same(got, published)
    assert all(got[n] is into[n] for n in into)
    assert "that differ from its own plan" in got.stats[liar]["dropped"]
    assert sum(copied) < (16 << 20) // 2, f"{sum(copied)} of the tensors' bytes copied out of stripe buffers"


def test_wrong_step_is_one_line(holders):
    address, _, _ = holders("--state", "nested", "--step", "7")
    with pytest.raises(collective.FetchError, match=rf"^holder h0 at {address} publishes step 7, not step 8$"):
        collective.fetch(address, step=8, token=TOKEN, timeout=60)


def test_bad_token_is_refused_naming_the_holder(holders):
    address, _, _ = holders("--state", "nested")
    with pytest.raises(collective.AuthError, match=rf"^holder( .+)? at {address} refused the cluster token") as info:
        collective.fetch(address, step=8, token="not-the-token", timeout=60)
    text = str(info.value)
    assert text.endswith("set COLLECTIVE_TOKEN (or token=) to the token the holders were started with"), text
    assert "chief" not in text, text


def test_holders_that_disagree_on_the_manifest_are_refused(holders):
    a, _, _ = holders("--state", "nested")
    b, _, _ = holders("--state", "big", "--mib", "1")
    with pytest.raises(collective.FetchError) as err:
        collective.fetch([a, b], step=8, token=TOKEN, timeout=60)
    assert "holders disagree on the manifest of step 8" in str(err.value) and a in str(err.value) and b in str(err.value)


def test_holders_of_one_manifest_in_other_chunks_are_not_mixed(holders):
    a, published, _ = holders("--state", "nested", "--chunk-bytes", "256")
    b, _, _ = holders("--state", "nested", "--chunk-bytes", "512")  # the same state, cut otherwise
    got = collective.fetch([a, b], step=8, token=TOKEN, timeout=60)
    _same(got, published)
    assert list(got.stats) == [a] and got.stats[a]["dropped"] is None  # b left out, not blamed


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
    with pytest.raises(collective.ProtocolError, match=rf"holder h0 at {address} sent a structure that is not JSON"):
        collective.fetch(address, step=8, token=TOKEN, timeout=60)
    assert not canary.exists()


@pytest.mark.parametrize("path", ["grpc", "tcp"])
def test_stripes_travel_over_every_data_path(monkeypatch, path):
    monkeypatch.setenv("COLLECTIVE_DATA_PATH", path)  # FetchRaw over gRPC, or the TCP port even on one host
    state = {f"w{i}": np.random.default_rng(i).random(100_000) for i in range(4)}
    pubs = [collective.publish(state, step=2, bind="127.0.0.1:0", token=TOKEN, chunk_bytes=1 << 18) for _ in range(2)]
    try:
        got = collective.fetch([p.address for p in pubs], step=2, token=TOKEN, timeout=60)
    finally:
        for p in pubs:
            p.close()
    assert all(np.array_equal(got[k], v) for k, v in state.items())
    assert all(s["stripes"] > 0 for s in got.stats.values()), got.stats


def test_a_plan_of_absurd_size_is_refused_before_allocating():
    pub = collective.publish({"x": np.arange(4.0)}, step=1, bind="127.0.0.1:0", token=TOKEN)
    try:
        pub._handler.plan.total_bytes = 1 << 60  # a hostile holder's claim
        with pytest.raises(collective.ResourceExhaustedError, match="refused before allocating"):
            collective.fetch(pub.address, step=1, token=TOKEN, timeout=30)
    finally:
        pub.close()


def test_an_oversize_plan_or_structure_is_refused_naming_the_holder(monkeypatch):
    from collective.snapshot import fetcher

    with collective.publish({"x": np.arange(4.0), "meta": {"k": "v" * 300}}, step=1, bind="127.0.0.1:0",
                            token=TOKEN) as pub:
        monkeypatch.setattr(fetcher, "MAX_SNAPSHOT_PLAN_BYTES", 100)  # as if the holder's plan were huge
        with pytest.raises(collective.ProtocolError, match=rf"holder at {pub.address} sent a Plan in pieces"):
            collective.fetch(pub.address, step=1, token=TOKEN, timeout=30)
        monkeypatch.undo()
        monkeypatch.setattr(tree, "MAX_TREE_BYTES", 200)
        with pytest.raises(collective.ProtocolError, match=rf"holder {re.escape(pub.name)} at {pub.address} sent a plan whose structure takes \d+ bytes"):
            collective.fetch(pub.address, step=1, token=TOKEN, timeout=30)


def test_close_stops_serving_and_is_idempotent():
    state = {"x": np.arange(1000, dtype=np.int32)}
    with collective.publish(state, step=3, bind="127.0.0.1:0", token=TOKEN, copy=True) as pub:
        state["x"][:] = 0  # copy=True: the caller may change its arrays at once
        got = collective.fetch(pub.address, step=3, token=TOKEN, timeout=30)
        assert np.array_equal(got["x"], np.arange(1000))
    pub.close()
    with pytest.raises(collective.CollectiveError, match=f"holder at {pub.address}"):
        collective.fetch(pub.address, step=3, token=TOKEN, timeout=5)


def test_the_fetch_command_writes_the_state_to_a_file(holders, tmp_path):
    import subprocess
    import sys

    from collective.sources import load_source

    address, published, _ = holders("--state", "nested")
    env = {**os.environ, "COLLECTIVE_TOKEN": TOKEN}
    out = tmp_path / "state.safetensors"
    run = subprocess.run([sys.executable, "-m", "collective.cli", "fetch", "--from", address, "--step", "8", "--out", str(out)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert "fetched step 8 (3 tensors" in run.stdout and f"from {address}" in run.stdout
    source = load_source(str(out))
    values = {}
    for spec in source.specs():
        values[spec.name] = np.empty(spec.shape, spec.np_dtype)
        source.fill(spec, values[spec.name])
    assert {n: array_digest(a) for n, a in values.items()} == published["digests"]
    run = subprocess.run([sys.executable, "-m", "collective.cli", "fetch", "--from", address, "--step", "9", "--out",
                          str(tmp_path / "x.npz")], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 1 and run.stderr.strip().splitlines() == [
        f"collective fetch: error: holder h0 at {address} publishes step 8, not step 9"], run.stderr


def test_mutual_tls_fetch_presents_its_certificate(tmp_path):
    import subprocess

    from collective.config import TlsFiles
    from tests.procs import ROOT

    subprocess.run(["bash", str(ROOT / "scripts" / "make-certs.sh"), str(tmp_path), "worker-1"], check=True,
                   capture_output=True, timeout=60)
    server = TlsFiles(cert=str(tmp_path / "chief.pem"), key=str(tmp_path / "chief.key"), ca=str(tmp_path / "ca.pem"))
    client = TlsFiles(ca=str(tmp_path / "ca.pem"), cert=str(tmp_path / "worker-1.pem"), key=str(tmp_path / "worker-1.key"))
    state = {"w": np.arange(100.0)}
    with collective.publish(state, step=4, bind="127.0.0.1:0", token=TOKEN, tls=server) as pub:
        got = collective.fetch(pub.address, step=4, token=TOKEN, timeout=30, tls=client)
        assert np.array_equal(got["w"], state["w"])
        with pytest.raises(collective.CollectiveError, match=f"holder at {pub.address}"):  # no certificate
            collective.fetch(pub.address, step=4, token=TOKEN, timeout=10, tls=TlsFiles(ca=str(tmp_path / "ca.pem")))


def test_close_lets_a_fetch_in_progress_finish_then_refuses(monkeypatch):
    from collective.stream import Chunker

    frames = Chunker.frames

    def paced(self, *args, **kwargs):  # a slow uplink: 0.1 s a chunk, 8 chunks
        for item in frames(self, *args, **kwargs):
            time.sleep(0.1)
            yield item

    monkeypatch.setattr(Chunker, "frames", paced)
    state = {"x": np.random.default_rng(0).random(1 << 20)}  # 8 MiB
    pub = collective.publish(state, step=2, bind="127.0.0.1:0", token=TOKEN, chunk_bytes=1 << 20)
    result: dict = {}
    fetcher = threading.Thread(target=lambda: result.update(
        got=_catch(lambda: collective.fetch(pub.address, step=2, token=TOKEN, timeout=60))))
    fetcher.start()
    deadline = time.monotonic() + 30
    while pub.stats()["bytes_served"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    closer = threading.Thread(target=pub.close, kwargs={"grace": 30})
    closer.start()  # returns once the fetch in progress is done (its stripes one after another)
    time.sleep(0.2)
    with pytest.raises(collective.AbortedError, match=r"publishes nothing now \(its step 2 was withdrawn or closed\)"):  # a new fetch meanwhile
        collective.fetch(pub.address, step=2, token=TOKEN, timeout=10)
    closer.join(40)
    assert not fetcher.is_alive() and not closer.is_alive()
    assert not isinstance(result["got"], Exception), result["got"]
    assert np.array_equal(result["got"]["x"], state["x"])
    with pytest.raises(collective.ChiefUnreachableError, match=f"holder at {pub.address} unreachable"):
        collective.fetch(pub.address, step=2, token=TOKEN, timeout=10)


def test_a_fetch_that_outlasts_its_timeout_is_one_line_naming_what_is_missing(monkeypatch):
    from collective.stream import Chunker

    frames = Chunker.frames

    def slow(self, *args, **kwargs):  # a holder that trickles: 1 s a chunk
        for item in frames(self, *args, **kwargs):
            time.sleep(1.0)
            yield item

    monkeypatch.setattr(Chunker, "frames", slow)
    with collective.publish({"x": np.zeros(1 << 20)}, step=5, bind="127.0.0.1:0", token=TOKEN, chunk_bytes=1 << 20) as pub:
        started = time.monotonic()
        with pytest.raises(collective.DeadlineError, match=r"^fetch did not complete within 2.5 s; still missing bytes \d+\.\.\d+ \('x' \.\. '#tree'\)$"):
            collective.fetch(pub.address, step=5, token=TOKEN, timeout=2.5, stall_timeout=30)
        assert time.monotonic() - started < 15  # the deadline, not the 8 s the holder would take


def _catch(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - handed to the test's thread
        return exc


def test_the_fetch_receives_into_the_shared_receive_arena(monkeypatch):
    # One allocator (arena.lazy_arena, then warm: a stripe's pages in place before it is asked
    # for) for the broadcast's and the fetch's arenas (tests/unit/test_plan.py checks how).
    from collective.snapshot import fetcher

    made = []
    real = fetcher.lazy_arena
    monkeypatch.setattr(fetcher, "lazy_arena", lambda nbytes: made.append(real(nbytes)) or made[-1])
    state = {"x": np.arange(300_000, dtype=np.float32)}
    with collective.publish(state, step=4, bind="127.0.0.1:0", token=TOKEN) as pub:
        got = collective.fetch(pub.address, step=4, token=TOKEN, timeout=30, shm=False)
    assert np.array_equal(got["x"], state["x"])
    assert any(np.shares_memory(got["x"], a) for a in made), "the fetch received into an arena of its own making"


def test_an_http_server_at_the_holders_address_is_one_protocol_line():
    # torchft's HTTPTransport (or any HTTP/1 server) answers the connect: not "unreachable",
    # which callers retry while a holder is not listening yet.
    import http.server

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(collective.ProtocolError) as info:
            collective.fetch(address, step=1, token=TOKEN, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    text = str(info.value)
    assert "\n" not in text
    assert re.match(rf"holder( .+)? at {address} does not speak collective's protocol \(Failed parsing HTTP/2", text), text


def test_errors_name_the_holder_by_its_publication_name_printed_safely():
    from collective.limits import MAX_HOLDER_NAME_CHARS

    state = {"x": np.arange(8.0)}
    with collective.publish(state, step=5, bind="127.0.0.1:0", token=TOKEN, name="replica\x1b[2J 3") as pub:
        with pytest.raises(collective.FetchError) as info:
            collective.fetch(pub.address, step=6, token=TOKEN, timeout=30)
    assert str(info.value) == f"holder replica\\x1b[2J 3 at {pub.address} publishes step 5, not step 6"
    with collective.publish(state, step=5, bind="127.0.0.1:0", token=TOKEN) as pub:
        assert pub.name == f"{socket.gethostname()}:{os.getpid()}"
        with pytest.raises(collective.FetchError, match=rf"^holder {re.escape(pub.name)} at {pub.address} publishes"):
            collective.fetch(pub.address, step=6, token=TOKEN, timeout=30)
    with pytest.raises(collective.UsageError, match=rf"a publication's name is 1..{MAX_HOLDER_NAME_CHARS} characters"):
        collective.publish(state, step=5, bind="127.0.0.1:0", token=TOKEN, name="n" * (MAX_HOLDER_NAME_CHARS + 1))


@pytest.mark.parametrize("copy", [False, True])
def test_replace_serves_a_new_step_at_the_same_listening_socket(copy):
    first = {"w": np.arange(1000, dtype=np.float32)}
    second = {"w": np.arange(1000, dtype=np.float32) * 2, "extra": np.ones(7)}
    with collective.publish(first, step=1, bind="127.0.0.1:0", token=TOKEN, copy=copy, name="g") as pub:
        address, listening = pub.address, pub._endpoint
        assert np.array_equal(collective.fetch(address, step=1, token=TOKEN, timeout=30)["w"], first["w"])
        pub.withdraw()
        with pytest.raises(collective.AbortedError, match=r"publishes nothing now \(its step 1 was withdrawn"):
            collective.fetch(address, step=1, token=TOKEN, timeout=30)
        with socket.create_connection(("127.0.0.1", int(address.rpartition(":")[2])), timeout=5):
            pass  # withdrawn, still listening
        pub.replace(second, step=2)
        assert (pub.address, pub._endpoint, pub.step) == (address, listening, 2)
        got = collective.fetch(address, step=2, token=TOKEN, timeout=30)
        assert np.array_equal(got["w"], second["w"]) and np.array_equal(got["extra"], second["extra"])
        assert got.manifest_digest == pub.manifest_digest
        with pytest.raises(collective.FetchError, match=rf"^holder g at {address} publishes step 2, not step 1$"):
            collective.fetch(address, step=1, token=TOKEN, timeout=30)
    with pytest.raises(collective.UsageError, match="is closed"):
        pub.replace(first, step=3)
