"""A publisher process and subscriber processes (tests/subscribe_roles.py) over gRPC on
127.0.0.1: every step a subscriber applied has the publisher's manifest of that step; a
subscriber SIGKILLed while steps flow restarts and catches up."""

from __future__ import annotations

import json
import signal

import pytest

from tests.clusters import TOKEN
from tests.procs import Proc, wait_for_file, wait_until

pytestmark = pytest.mark.integration

STEPS = 6


def _lines(proc: Proc) -> list[dict]:
    return [json.loads(line) for line in proc.output().splitlines() if line.startswith("{")]


def test_subscribers_apply_every_step_with_the_publishers_manifest_and_a_killed_one_catches_up(tmp_path):
    env = {"COLLECTIVE_TOKEN": TOKEN}
    addr = tmp_path / "address"
    procs: list[Proc] = []
    try:
        pub = Proc(["-m", "tests.subscribe_roles", "publisher", "--address-file", str(addr), "--steps", str(STEPS)],
                   tmp_path / "pub.log", env=env)
        procs.append(pub)
        address = wait_for_file(addr, pub, timeout=60)
        subs = [Proc(["-m", "tests.subscribe_roles", "subscriber", "--source", address, "--until", str(STEPS),
                      *(["--no-shm"] if i else [])], tmp_path / f"sub{i}.log", env=env) for i in range(2)]
        procs += subs
        victim = Proc(["-m", "tests.subscribe_roles", "subscriber", "--source", address, "--until", str(STEPS)],
                      tmp_path / "victim.log", env=env)
        procs.append(victim)
        for p in (*subs, victim):  # every one has its first step before the steps begin
            wait_until(lambda p=p: _lines(p) or p.proc.poll() is not None, "a subscriber's first step", timeout=120)
        addr.with_name("address.go").write_text("")
        wait_until(lambda: any(line["step"] >= 1 for line in _lines(victim)) or victim.proc.poll() is not None,
                   "the victim's first step", timeout=120)
        victim.signal(signal.SIGKILL)
        assert victim.wait(10) == -signal.SIGKILL
        again = Proc(["-m", "tests.subscribe_roles", "subscriber", "--source", address, "--until", str(STEPS)],
                     tmp_path / "again.log", env=env)
        procs.append(again)
        for p in (*subs, again):
            assert p.wait(180) == 0, p.output()
        addr.with_name("address.stop").write_text("")
        assert pub.wait(60) == 0, pub.output()
        published = {line["step"]: line["manifest"] for line in _lines(pub)}
        assert sorted(published) == list(range(STEPS + 1))
        for p in (*subs, again):
            applied = _lines(p)
            assert applied[-1]["step"] == STEPS
            for line in applied:
                assert published[line["step"]] == line["manifest"], (line, p.output())
        # A subscriber that followed from the start took the steps as deltas, not whole.
        assert any(line["kind"] == "delta" for p in subs for line in _lines(p))
    finally:
        for p in procs:
            p.kill()
