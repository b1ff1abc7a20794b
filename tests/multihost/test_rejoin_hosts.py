"""A worker killed mid-broadcast (kill -9 by pid) and restarted with the same worker id rejoins
on emulated hosts, and the others go on: the round completes, every digest is the chief's, no
other worker process restarted, in a chain, a tree and a double tree. The links are shaped so the broadcast
takes seconds; the victim's own interface counter says when half the model has reached it.

Prints the detection time (kill -> the chief's "was lost" line) and the healing time (restart
-> start released), both from the chief's log timestamps."""

from __future__ import annotations

import calendar
import json
import os
import re
import signal
import time
import uuid

import pytest

from collective.bench import write_spec
from tests.multihost.netns import Topology, wait_all

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(600)]

SIZE = 256 << 20
WORKERS = 4
RATE = "200mbit"  # about 11 s for 256 MiB per link
HB = ["--heartbeat-interval", "0.5", "--heartbeat-timeout", "10"]
# chain: 0 <- chief, 1 <- 0, 2 <- 1, 3 <- 2; tree (binomial): 0, 1, 3 <- chief, 2 <- 0; dtree
# (topology.dtree_parents(4)): tree A 0 <- chief, 2 <- 0, 1 and 3 <- 2; tree B 3 <- chief,
# 1 <- 3, 0 and 2 <- 1 (rank 2 is interior in tree A only, its children resume tree A's half).
CASES = {"chain": (1, [2]), "tree": (0, [2]), "dtree": (2, [1, 3])}


def _stamp(line: str) -> float:
    """The wall-clock time of a log line (``2026-12-05T13:10:00.123Z ...``)."""
    text = line.split()[0].rstrip("Z")
    whole, _, ms = text.partition(".")
    return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + int(ms or 0) / 1000


def _line(output: str, pattern: str) -> str:
    m = re.search(rf"^.*{pattern}.*$", output, re.M)
    assert m, f"no line matching {pattern!r} in:\n{output}"
    return m.group(0)


@pytest.mark.parametrize("topology", sorted(CASES))
def test_a_worker_killed_at_half_the_broadcast_and_restarted_rejoins_and_the_others_go_on(
        tmp_path, namespaces, topology, report_figure):
    victim_rank, orphans = CASES[topology]
    spec = write_spec(tmp_path / "model.yaml", SIZE, 16)
    result_file = tmp_path / "result.json"
    env = {"COLLECTIVE_TOKEN": uuid.uuid4().hex}
    hosts = [f"host-{r}" for r in range(WORKERS)]
    victim_host = hosts[victim_rank]
    with Topology(["chief", *hosts], tmp_path) as net:
        for h in hosts:
            net.shape(h, RATE)
        chief = net.run("chief", ["python", "-m", "collective.chief", "--workers", str(WORKERS), "--model", str(spec),
                                  "--bind", "0.0.0.0:50051", "--result-file", str(result_file), "--topology", topology,
                                  "--join-timeout", "120", "--ready-timeout", "400", "--rejoin-timeout", "120", *HB],
                        env=env, name="chief")
        chief.wait_for("serving on", 120)

        def worker(rank: int, name: str):
            return net.run(hosts[rank], ["python", "-m", "collective.worker", "--chief", "chief:50051",
                                         "--worker-id", f"w{rank}", "--rank", str(rank), "--join-timeout", "120",
                                         "--start-timeout", "400", *HB], env=env, name=name)

        before = net.link_bytes(victim_host)["rx"]
        procs = {r: worker(r, f"w{r}") for r in range(WORKERS)}
        pids = {r: p.pid for r, p in procs.items()}
        victim = procs[victim_rank]
        deadline = time.monotonic() + 300
        while net.link_bytes(victim_host)["rx"] - before < SIZE // 2:  # half the model has reached it
            assert victim.returncode is None and time.monotonic() < deadline, victim.output()
            time.sleep(0.05)
        victim_had = net.link_bytes(victim_host)["rx"] - before
        killed_at = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        assert victim.wait(30) == -signal.SIGKILL
        chief.wait_for(rf"worker w{victim_rank} \(rank {victim_rank}, .*was lost during the broadcast.*waiting up to",
                       120)
        lost_line = _line(chief.output(), "was lost during the broadcast")
        restarted_at = time.time()
        reborn = worker(victim_rank, f"w{victim_rank}-reborn")
        others = [p for r, p in procs.items() if r != victim_rank]
        codes = wait_all([chief, reborn, *others], 400)
        outputs = {p.name: p.output() for p in [chief, victim, reborn, *others]}
    assert codes == dict.fromkeys(codes, 0), {n: o[-3000:] for n, o in outputs.items()}
    result = json.loads(result_file.read_text())
    assert result["ok"] is True, result["error"]
    assert result["rejoined"] == [f"w{victim_rank}"]

    # Every worker's digest is the one the chief requires, and what the worker itself logged.
    by_rank = {w["rank"]: w for w in result["workers"]}
    assert sorted(by_rank) == list(range(WORKERS))
    for r, w in by_rank.items():
        assert w["digest"] and w["digest"] == w["expected_digest"], w
        name = f"w{r}-reborn" if r == victim_rank else f"w{r}"
        assert f"worker digest {w['digest']}" in outputs[name], outputs[name][-2000:]
    # Nobody else restarted: one process each, started once, one incarnation, exit 0 (above).
    incarnation = {}
    for r in range(WORKERS):
        name = f"w{r}-reborn" if r == victim_rank else f"w{r}"
        joined = re.findall(r"joined chief at \S+ as rank \d+ of \d+ \(incarnation (\w+)\)", outputs[name])
        assert len(joined) == 1, (name, joined)
        incarnation[r] = joined[0]
        assert by_rank[r]["incarnation"] == incarnation[r]
        assert by_rank[r]["pid"] == (reborn.pid if r == victim_rank else pids[r])
    old = re.findall(r"joined chief at \S+ as rank \d+ of \d+ \(incarnation (\w+)\)", outputs[f"w{victim_rank}"])
    assert len(old) == 1 and old[0] != incarnation[victim_rank]
    # The victim's children resumed from its nearest live ancestor where they stood, not from byte 0.
    for r in orphans:
        resumed = re.findall(r"resuming the stream at byte (\d+)", outputs[f"w{r}"])
        assert resumed and int(resumed[0]) > 0, outputs[f"w{r}"][-3000:]

    chief_out = outputs["chief"]
    rejoined = _stamp(_line(chief_out, f"worker w{victim_rank} .*rejoined as incarnation"))
    started = _stamp(_line(chief_out, "start released"))
    detection = _stamp(lost_line) - killed_at
    healing = started - restarted_at
    figure = (f"rejoin ({topology}, {WORKERS} workers, {SIZE >> 20} MiB, links {RATE}): victim rank {victim_rank} "
              f"killed at {victim_had / SIZE:.0%} of the model; detection {detection:.2f} s (kill -> chief's "
              f"'was lost'); rejoin {rejoined - restarted_at:.2f} s (restart -> admitted); healing {healing:.2f} s "
              f"(restart -> start released)")
    print(figure)
    report_figure(figure)
