"""collective.torchft.Transport against holders that lie: every refusal is one line naming the
holder, and nothing received is ever unpickled or run (a pickle payload whose unpickling would
create a marker file leaves no file). Holders are real publications on loopback in this
process, bent by test-only hooks after (or instead of) ``publish``; the last test runs the
refusal inside a real torchft job."""

from __future__ import annotations

import os
import pickle
import re
import threading
import time
from datetime import timedelta

import numpy as np
import pytest

from tests.framework.conftest import require

pytestmark = pytest.mark.integration
TOKEN = "the-token"
T = timedelta(seconds=5)


class Marker:
    """Unpickling this creates directory ``path``: what a peer's pickle would run in the receiver."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.fixture
def torch():
    require("torchft")
    return require("torch")


@pytest.fixture
def transports():
    import collective.torchft

    made = []

    def make(**kw):
        made.append(collective.torchft.Transport(token=TOKEN, bind="127.0.0.1:0", timeout=5.0,
                                                 **{"name": f"group{len(made)}", **kw}))
        return made[-1]

    yield make
    for t in made:
        t.shutdown()


def state(torch):
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return {"user": {"default": {"model": model.state_dict(), "optim": opt.state_dict()}},
            "torchft": {"step": 3, "batches_committed": 6}}


def refused(fn, cls):
    with pytest.raises(cls) as info:
        fn()
    text = str(info.value)
    assert "\n" not in text, text
    return text


def test_the_state_arrives_whole_and_equal(torch, transports):
    holder, fetcher = transports(), transports()
    sent = state(torch)
    holder.send_checkpoint([1], 3, sent, T)
    got = fetcher.recv_checkpoint(0, holder.metadata(), 3, T)
    assert got["torchft"] == {"step": 3, "batches_committed": 6}
    for k, v in sent["user"]["default"]["model"].items():
        assert torch.equal(got["user"]["default"]["model"][k], v)
    assert torch.equal(got["user"]["default"]["optim"]["state"][0]["exp_avg"],
                       sent["user"]["default"]["optim"]["state"][0]["exp_avg"])  # int keys kept
    assert got["user"]["default"]["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)


def test_a_holder_whose_tensor_bytes_became_a_pickle_is_named(torch, transports, tmp_path):
    from collective.errors import IntegrityError

    holder, fetcher = transports(), transports()
    sent = state(torch)
    holder.send_checkpoint([1], 3, sent, T)
    # Served in place: the holder's tensor now holds a pickle instead of the bytes of its plan.
    weight = sent["user"]["default"]["model"]["weight"]
    payload = np.frombuffer(pickle.dumps(Marker(tmp_path / "ran")), np.uint8)
    weight.view(-1).view(torch.uint8)[: payload.size] = torch.from_numpy(payload.copy())
    text = refused(lambda: fetcher.recv_checkpoint(0, holder.metadata(), 3, T), IntegrityError)
    assert re.match(rf"holder group0 at {re.escape(holder.metadata())} sent bytes of 'user/default/model/weight' "
                    r"that differ from its own plan", text), text
    assert not (tmp_path / "ran").exists()


def test_a_holder_of_another_step_is_named(torch, transports):
    from collective.errors import FetchError

    holder, fetcher = transports(), transports()
    holder.send_checkpoint([1], 4, state(torch), T)
    text = refused(lambda: fetcher.recv_checkpoint(0, holder.metadata(), 3, T), FetchError)
    assert text == f"holder group0 at {holder.metadata()} publishes step 4, not step 3"


def test_a_holder_whose_structure_is_a_pickle_is_refused_and_nothing_runs(torch, transports, tmp_path, monkeypatch):
    from collective.errors import ProtocolError
    from collective.snapshot import tree

    holder, fetcher = transports(), transports()
    # The holder's structure variable is a pickle (as torchft's HTTPTransport sends), its plan's
    # digests computed over it: every chunk checks out, and still nothing may run.
    monkeypatch.setattr(tree, "encode", lambda skeleton, step: np.frombuffer(
        pickle.dumps({"tree": Marker(tmp_path / "ran")}), np.uint8))
    holder.send_checkpoint([1], 3, state(torch), T)
    monkeypatch.undo()
    text = refused(lambda: fetcher.recv_checkpoint(0, holder.metadata(), 3, T), ProtocolError)
    assert text.startswith(f"holder group0 at {holder.metadata()} sent a structure that is not JSON"), text
    assert not (tmp_path / "ran").exists()


# torchft's receiver warns about the non-writable buffer it unpickles tensors from.
@pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")
def test_a_torchft_http_holder_serving_a_pickle_is_refused_where_torchft_runs_it(torch, transports, tmp_path):
    from torchft.checkpointing.http_transport import HTTPTransport

    from collective.errors import ProtocolError

    http = HTTPTransport(timeout=T, num_chunks=0)
    try:
        http.send_checkpoint([1], 3, {"user": {"w": torch.zeros(3)}, "x": Marker(tmp_path / "torchft-ran")}, T)
        # The control: torchft's own receiver unpickles the payload, and it runs.
        HTTPTransport(timeout=T, num_chunks=0).recv_checkpoint(0, http.metadata(), 3, T)
        assert (tmp_path / "torchft-ran").exists()
        port = re.search(r":(\d+)/", http.metadata()).group(1)
        fetcher = transports()
        fetcher._timeout = 60.0  # it would retry an unreachable holder until then: not this one
        started = time.monotonic()
        text = refused(lambda: fetcher.recv_checkpoint(0, f"127.0.0.1:{port}", 3, timedelta(seconds=60)),
                       ProtocolError)
        assert re.match(rf"holder( .+)? at 127.0.0.1:{port} does not speak collective's protocol \(", text), text
        assert time.monotonic() - started < 30, "retried as if the holder were not listening yet"
        assert not (tmp_path / "ran").exists()
    finally:
        http.shutdown()
        http._server.server_close()  # torchft's shutdown leaves its listening socket open


def test_a_wrong_token_and_foreign_metadata_are_one_line(torch, transports):
    import collective.torchft
    from collective.errors import AuthError, UsageError

    holder = transports()
    holder.send_checkpoint([1], 3, state(torch), T)
    other = collective.torchft.Transport(token="another-token", timeout=5.0)
    text = refused(lambda: other.recv_checkpoint(0, holder.metadata(), 3, T), AuthError)
    assert text.startswith(f"holder at {holder.metadata()} refused the cluster token"), text
    text = refused(lambda: other.recv_checkpoint(0, "http://vm:1234/checkpoint/", 3, T), UsageError)
    assert "every replica group must use collective.torchft.Transport" in text


def test_a_state_with_an_object_leaf_is_refused_before_publishing(torch, transports):
    from collective.errors import UsageError

    holder = transports()
    sent = state(torch)
    sent["user"]["default"]["scheduler"] = {"fn": threading.Lock()}
    text = refused(lambda: holder.send_checkpoint([1], 3, sent, T), UsageError)
    assert text.startswith("state['user']['default']['scheduler']['fn']: a lock is neither a tensor"), text


def test_disallow_stops_serving_and_a_late_holder_is_waited_for(torch, transports):
    from collective.errors import AbortedError

    holder, fetcher = transports(), transports()
    sent = state(torch)
    address = holder.metadata()  # given out before anything is published, as torchft does
    timer = threading.Timer(0.5, holder.send_checkpoint, ([1], 3, sent, T))
    timer.start()
    try:
        assert fetcher.recv_checkpoint(0, address, 3, T)["torchft"]["step"] == 3
    finally:
        timer.join()
    holder.disallow_checkpoint()  # torchft mutates the state from here on: nothing is served
    fetcher._timeout = 1.0  # retried until then: the holder may publish again
    text = refused(lambda: fetcher.recv_checkpoint(0, address, 3, T), AbortedError)
    assert "publishes nothing now (its step 3 was withdrawn or closed)" in text, text
    holder.send_checkpoint([1], 4, sent, T)  # the next recovery serves at the same address again
    assert fetcher.recv_checkpoint(0, address, 4, T)["torchft"]["step"] == 3


def test_the_address_given_out_is_held_from_then_on_across_steps(torch, transports):
    import socket

    import collective.torchft
    from collective.errors import UsageError

    holder, fetcher = transports(), transports()
    address = holder.metadata()  # listening from here on: no other process can take the port
    with socket.socket() as squatter, pytest.raises(OSError):
        squatter.bind(("127.0.0.1", int(address.rpartition(":")[2])))
    for step in (3, 4):
        holder.send_checkpoint([1], step, state(torch), T)
        assert holder.metadata() == address
        assert fetcher.recv_checkpoint(0, address, step, T)["torchft"]["step"] == 3
        holder.disallow_checkpoint()

    text = refused(lambda: collective.torchft.Transport(bind="127.0.0.1"), UsageError)
    assert text.startswith("bind='127.0.0.1' is not host:port"), text


def test_tls_on_both_sides_and_a_fetcher_without_it_refused(torch, tmp_path):
    import subprocess

    import collective.torchft
    from collective.config import TlsFiles
    from collective.errors import CollectiveError
    from tests.procs import ROOT

    subprocess.run(["bash", str(ROOT / "scripts" / "make-certs.sh"), str(tmp_path), "worker-1"], check=True,
                   capture_output=True, timeout=60)
    # One TlsFiles serves both roles of a group: its certificate when it holds, the CA when it fetches.
    tls = TlsFiles(cert=str(tmp_path / "chief.pem"), key=str(tmp_path / "chief.key"), ca=str(tmp_path / "ca.pem"))
    holder = collective.torchft.Transport(token=TOKEN, bind="127.0.0.1:0", timeout=5.0, tls=tls)
    fetcher = collective.torchft.Transport(token=TOKEN, bind="127.0.0.1:0", timeout=5.0, tls=tls)
    plain = collective.torchft.Transport(token=TOKEN, bind="127.0.0.1:0", timeout=1.0)
    try:
        holder.send_checkpoint([1], 3, state(torch), T)
        assert fetcher.recv_checkpoint(0, holder.metadata(), 3, T)["torchft"]["step"] == 3
        text = refused(lambda: plain.recv_checkpoint(0, holder.metadata(), 3, T), CollectiveError)
        assert text.startswith(f"holder at {holder.metadata()}"), text
    finally:
        holder.shutdown()
