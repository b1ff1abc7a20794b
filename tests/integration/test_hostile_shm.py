"""A hostile same-host holder hands a fetcher a memory file it can still change (issue 36, item 1):
never mapped. The holder (tests/hostile_shm.py) is ``collective.publish(copy=True)`` with its
seal replaced; after the fetch returned it writes over the file or cuts it to 0 bytes. The
fetcher, a process of its own (a mapping cut short kills it with SIGBUS), must have taken the
stream: what it returned keeps the digests it was verified with, and it lives."""

from __future__ import annotations

import json
import platform

import pytest

from tests.clusters import TOKEN
from tests.procs import Proc, wait_for_file

pytestmark = pytest.mark.integration

FUTURE_WRITE = tuple(int(x) for x in platform.release().split(".")[:2]) >= (5, 1)


@pytest.mark.timeout(420)  # its waits: 120 + 150 + 60 + 60 s
@pytest.mark.parametrize(("mode", "act"), [
    ("unsealed", "write"),
    ("unsealed", "truncate"),
    pytest.param("future-write", "write", marks=pytest.mark.skipif(not FUTURE_WRITE, reason="F_SEAL_FUTURE_WRITE needs Linux 5.1")),
    ("no-shrink", "truncate"),
])
def test_a_fetch_never_maps_a_memory_file_its_holder_can_still_change(tmp_path, mode, act):
    holder_dir, fetcher_dir = tmp_path / "holder", tmp_path / "fetcher"
    holder_dir.mkdir()
    fetcher_dir.mkdir()
    env = {"COLLECTIVE_TOKEN": TOKEN}
    procs = []
    try:
        holder = Proc(["-m", "tests.hostile_shm", "hold", "--folder", str(holder_dir), "--mode", mode],
                      holder_dir / "log", env=env)
        procs.append(holder)
        address = wait_for_file(holder_dir / "address", holder, timeout=120)
        published = json.loads((holder_dir / "published.json").read_text())
        fetcher = Proc(["-m", "tests.hostile_shm", "fetch", "--folder", str(fetcher_dir), "--address", address],
                       fetcher_dir / "log", env=env)
        procs.append(fetcher)
        fetched = json.loads(wait_for_file(fetcher_dir / "fetched.json", fetcher, timeout=150))
        assert fetched["digests"] == published  # verified, whichever way it came

        (holder_dir / "act").write_text(act)
        wait_for_file(holder_dir / "done", holder, timeout=60)
        (fetcher_dir / "recheck").write_text("")
        rc = fetcher.wait(60)
        assert rc == 0, f"the fetcher ended with {rc} after the holder's {act}:\n{fetcher.output()}"
        after = json.loads((fetcher_dir / "after.json").read_text())
        assert after == published, f"bytes changed after the fetch returned them verified:\n{fetcher.output()}"
        assert not fetched["shared_memory"]
        assert "offers shared memory not sealed against" in fetcher.output()
    finally:
        for proc in procs:
            proc.kill()


@pytest.mark.timeout(360)  # its waits: 120 + 120 + 60 s
def test_the_hostile_holder_really_can_change_what_was_mapped(tmp_path, monkeypatch):
    """The test above can fail: with the seal check removed (as attach() was before), the same
    holder's file is mapped and its write shows in the tensors the fetch returned verified."""
    import numpy as np

    import collective
    from collective.transport import shm

    monkeypatch.setattr(shm, "unsealed", lambda fd: None)
    folder = tmp_path / "holder"
    folder.mkdir()
    holder = Proc(["-m", "tests.hostile_shm", "hold", "--folder", str(folder), "--mode", "unsealed"],
                  folder / "log", env={"COLLECTIVE_TOKEN": TOKEN})
    try:
        address = wait_for_file(folder / "address", holder, timeout=120)
        got = collective.fetch(address, step=3, token=TOKEN, timeout=120)
        assert got.stats[address]["shared_memory"]
        (folder / "act").write_text("write")
        wait_for_file(folder / "done", holder, timeout=60)
        assert np.all(got["w0"].view(np.uint8) == 0xEE)
    finally:
        holder.kill()


# A worker process (``python -c`` this, then the worker's arguments) on "host-b", not the chief's
# host: two make a host whose leader receives from the network and serves its arena to the other.
ON_HOST_B = "import os, pathlib, socket, sys, time\nsocket.gethostname = lambda: 'host-b'\n"
MAIN = "from collective.worker.__main__ import main\nsys.exit(main(sys.argv[1:]))\n"

# The leader hands its peer its arena unsealed, keeps it writable, and once started (and told:
# the file $HOSTILE_ACT) writes 0xEE over it, then says so ($HOSTILE_DONE).
HOSTILE_LEADER = ON_HOST_B + (
    "from collective.transport import shm\n"
    "from collective.worker.agent import WorkerResult\n"
    "shm.attach = lambda *args, **kwargs: None  # the chief's bytes from the network, as on another host\n"
    "served = []\n"
    "def complete(self):\n"
    "    served.append(self.shared)\n"
    "    self.writable = None\n"
    "    self.server.publish()\n"
    "    return self.shared.private()\n"
    "shm.ServedArena.complete = complete\n"
    "def started(self):\n"
    "    print('leader started', flush=True)\n"
    "    act, deadline = pathlib.Path(os.environ['HOSTILE_ACT']), time.monotonic() + 120\n"
    "    while not act.exists() and time.monotonic() < deadline:\n"
    "        time.sleep(0.02)\n"
    "    served[0].array[:] = 0xEE\n"
    "    pathlib.Path(os.environ['HOSTILE_DONE']).write_text('')\n"
    "WorkerResult.log_started = started\n"
) + MAIN

# Its peer, once started, waits for the leader's write and checks every replica again.
CHECKING_PEER = ON_HOST_B + (
    "from collective.digest import array_digest\n"
    "from collective.worker.agent import WorkerResult\n"
    "def started(self):\n"
    "    print('peer started', flush=True)\n"
    "    done, deadline = pathlib.Path(os.environ['HOSTILE_DONE']), time.monotonic() + 120\n"
    "    while not done.exists() and time.monotonic() < deadline:\n"
    "        time.sleep(0.02)\n"
    "    changed = sorted({v.name for v in self.plan.variables for r in self.variables.get(v.name).replicas\n"
    "                      if array_digest(r) != v.digest})\n"
    "    print(f'changed after they were verified: {changed}' if changed else 'replicas still as verified', flush=True)\n"
    "WorkerResult.log_started = started\n"
) + MAIN


@pytest.mark.timeout(420)  # its waits: 180 + 60 + 60 + 60 s
def test_a_worker_never_maps_a_host_leaders_arena_the_leader_can_still_change(cluster, tmp_path):
    """The peer-arena attach (worker/agent.py) goes through the same check: a host leader that
    hands out its memory file unsealed is refused, its peer takes the leader's relay, and the
    leader's write after start does not reach the peer's replicas."""
    from tests.procs import wait_for

    env = {"HOSTILE_ACT": str(tmp_path / "act"), "HOSTILE_DONE": str(tmp_path / "done")}
    chief = cluster.chief("--workers", "2", "--topology", "chain")
    leader = cluster.worker("leader", "--rank", "0", env=env, code=HOSTILE_LEADER)
    peer = cluster.worker("peer", "--rank", "1", "--devices", "cpu:0,cpu:1", env=env, code=CHECKING_PEER)
    wait_for(peer, "peer started", timeout=180)
    wait_for(leader, "leader started", timeout=60)
    (tmp_path / "act").write_text("")
    assert peer.wait(60) == 0, peer.output()
    out = peer.output()
    assert "replicas still as verified" in out, out
    assert "worker leader (rank 0) offers shared memory not sealed against write, shrink, grow" in out, out
    assert chief.wait(60) == 0, chief.output()
