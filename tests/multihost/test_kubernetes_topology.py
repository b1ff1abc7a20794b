"""The manifests of deploy/kubernetes/, run as their controllers would run them, in network
namespaces (needs root; CI runs as root).

One emulated host per pod: its own address, its own host name (the pod's), its own /dev/shm and
a hosts file that resolves every pod by the names the cluster DNS gives it, from the start,
before anything listens (as headless Services publishing not-ready addresses do). Commands,
environment and ConfigMap volumes come from the manifests through tests/multihost/kube.py, with
exactly what JobSet / the training-operator add, so what is written in a manifest is what runs
here. One more host, "kubelet", asks the chief's gRPC health service as a kubelet's probe would.

In each run a worker starts before the chief and must ride out the refused connections until
the chief serves; every worker's digest is checked against the chief's view of the round.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

import pytest

from tests.multihost import kube
from tests.multihost.netns import Topology, wait_all

# Generous for a loaded 2-core machine: every wait below is on a condition, within this bound.
pytestmark = [pytest.mark.multihost, pytest.mark.timeout(300)]

PROBER = "kubelet"  # the node's side: not a pod


def secrets() -> dict[str, dict[str, str]]:
    """The Secret the manifests' README has users create (kubectl create secret generic ...)."""
    return {"collective-token": {"token": uuid.uuid4().hex}}


@dataclass
class Round:
    codes: dict[str, int]
    logs: dict[str, str]
    probes: dict[str, str]       # before / during / after -> what the probe saw
    received: dict[str, int]     # pod -> bytes received on its own link
    seconds: float               # the round: from the chief's start until every pod has exited

    def broadcast_seconds(self, chief: kube.Pod) -> float:
        """The chief's own figure: first byte sent until every worker is ready."""
        m = re.search(r"start released \(broadcast ([0-9.]+) s\)", self.logs[chief.name])
        assert m, self.logs[chief.name]
        return float(m.group(1))

    def figure(self, chief: kube.Pod) -> str:
        return f"round {self.seconds:.2f} s (chief start to every pod exited), broadcast {self.broadcast_seconds(chief):.3f} s"


def run_round(tmp_path, pods: list[kube.Pod], chief: kube.Pod, probe: dict, *, late_name: bool = False) -> Round:
    """Start the first worker, then the chief, then the other workers; probe the chief's health
    service from another namespace before the chief starts, while it serves and after the end.

    ``late_name``: the chief's name does not resolve until its pod runs (the training-operator's
    per-replica Service publishes a pod once it is Ready: with no readiness probe, once its
    container has started), so the first worker starts while the name is unknown."""
    workers = [p for p in pods if p is not chief]
    with Topology([p.short for p in pods] + [PROBER], tmp_path) as net:
        kube.prepare(net, pods, tmp_path, withheld=[chief] if late_name else [])
        chief_ip = net.hosts[chief.short].address
        first = kube.run(net, workers[0])
        # Its name resolves, nothing listens yet: the worker is refused and retries.
        first.wait_for(r"not reachable yet", 60)
        probes = {"before": kube.grpc_probe(net, PROBER, chief_ip, probe)}
        procs = [kube.run(net, chief), first]
        if late_name:
            kube.publish(net, chief, pods)
        procs[0].wait_for(r"serving on", 90)
        probes["during"] = kube.grpc_probe(net, PROBER, chief_ip, probe)
        procs += [kube.run(net, w) for w in workers[1:]]
        codes = wait_all(procs, 150)
        seconds = max(p.ended for p in procs) - procs[0].started
        probes["after"] = kube.grpc_probe(net, PROBER, chief_ip, probe)
        logs = {p.name: p.output() for p in procs}
        received = {w.name: net.link_bytes(w.short)["rx"] for w in workers}
    return Round(codes, logs, probes, received, seconds)


def json_line(log: str) -> dict:
    """The training script's one JSON line (the last line that parses)."""
    for line in reversed(log.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise AssertionError(f"no JSON line in:\n{log}")


def check_sync_round(rnd: Round, pods: list[kube.Pod], chief: kube.Pod, expected_ranks: dict[str, int]) -> dict:
    """A collective.sync round of training scripts: every rank holds rank 0's inputs bit for bit,
    every digest agrees, and rank 0's summary names every worker pod with that digest."""
    assert rnd.codes == dict.fromkeys(rnd.codes, 0), "\n".join(f"--- {k}\n{v}" for k, v in rnd.logs.items())
    lines = {p.name: json_line(rnd.logs[p.name]) for p in pods}
    truth = lines[chief.name]
    assert {n: ln["rank"] for n, ln in lines.items()} == expected_ranks, lines
    assert {ln["world_size"] for ln in lines.values()} == {len(pods)}
    for name, ln in lines.items():
        assert ln["held"] == truth["inputs"], name  # rank 0's values, bit for bit
        if name != chief.name:
            # Independently initialised: the values did come from the chief.
            assert ln["inputs"] != truth["inputs"], name
    digests = {ln["digest"] for ln in lines.values()}
    assert len(digests) == 1 and "" not in digests, lines
    summary = truth["summary"]
    assert summary["ok"] is True and summary["error"] is None, summary
    assert sorted(w["host"] for w in summary["workers"]) == sorted(p.name for p in pods if p is not chief)
    assert {w["digest"] for w in summary["workers"]} == digests
    for w in pods:
        if w is not chief:
            assert rnd.received[w.name] >= summary["bytes"], (w.name, rnd.received[w.name])
    return summary


def test_tfjob_chief_and_workers_get_tf_config_and_hold_the_chiefs_values(tmp_path, namespaces, report_figure):
    pods = kube.tfjob_pods(secrets=secrets())
    chief = next(p for p in pods if p.role == "chief")
    config = json.loads(chief.env["TF_CONFIG"])
    chief_port = int(config["cluster"]["chief"][0].rsplit(":", 1)[1])
    rnd = run_round(tmp_path, pods, chief, {"grpc": {"port": chief_port}})

    assert rnd.probes == {"before": "UNAVAILABLE", "during": "SERVING", "after": "UNAVAILABLE"}, rnd.probes
    # TF_CONFIG task worker i is training rank i + 1.
    ranks = {p.name: 0 if p is chief else p.index + 1 for p in pods}
    summary = check_sync_round(rnd, pods, chief, ranks)
    for p in pods:
        assert f"sync: rank {ranks[p.name]} of {len(pods)} (TF_CONFIG)" in rnd.logs[p.name], rnd.logs[p.name]
    report_figure(f"kubernetes TFJob: chief + {len(pods) - 1} workers, {summary['bytes']} bytes in "
                  f"{summary['seconds']:.3f} s (sync), {rnd.figure(chief)}, digest {summary['workers'][0]['digest'][:16]}…")


def test_jobset_chief_and_indexed_workers_complete_a_round_with_probes_as_written(tmp_path, namespaces, report_figure):
    pods = kube.jobset_pods(secrets=secrets())
    chief = next(p for p in pods if p.role == "chief")
    workers = [p for p in pods if p is not chief]
    probes = [chief.probe(k) for k in ("startup", "readiness", "liveness")]
    assert all(p and "grpc" in p for p in probes), probes
    # One health endpoint behind all three probes: asking it once asks each of them.
    assert len({(p["grpc"]["port"], p["grpc"].get("service", "")) for p in probes}) == 1, probes
    rnd = run_round(tmp_path, pods, chief, probes[0])

    assert rnd.probes == {"before": "UNAVAILABLE", "during": "SERVING", "after": "UNAVAILABLE"}, rnd.probes
    assert rnd.codes == dict.fromkeys(rnd.codes, 0), "\n".join(f"--- {k}\n{v}" for k, v in rnd.logs.items())
    chief_log = rnd.logs[chief.name]
    spec = kube.one(kube.load(kube.JOBSET), "ConfigMap")["data"]["model.yaml"]
    n_vars = len(re.findall(r"^\s+- \{name:", spec, re.M))
    worker_digests = {}
    for w in workers:
        line = re.search(r"training started: (\d+) variables x 1 replicas, worker digest (\w+)", rnd.logs[w.name])
        assert line, rnd.logs[w.name]
        assert int(line.group(1)) == n_vars  # the ConfigMap's model, as mounted
        worker_digests[w.name] = line.group(2)
        # The chief names it by its pod's host name, with its completion index as its rank.
        seen = re.search(rf"worker {w.name}-\d+ \(rank (\d+), host {w.name}\) is ready with digest (\w+)", chief_log)
        assert seen, chief_log
        assert int(seen.group(1)) == int(w.env["JOB_COMPLETION_INDEX"])
        assert line.group(2).startswith(seen.group(2))
        assert rnd.received[w.name] > 1_000_000, (w.name, rnd.received[w.name])  # the model crossed its link
    assert len(set(worker_digests.values())) == 1, worker_digests
    assert f"training started: {len(workers)} workers hold identical variables" in chief_log
    report_figure(f"kubernetes JobSet: chief + {len(workers)} indexed workers, {n_vars} variables from the "
                  f"ConfigMap, {rnd.figure(chief)}, probes before/during/after: {', '.join(rnd.probes.values())}")


def test_pytorchjob_master_and_workers_get_the_operators_variables_and_hold_rank_0s_values(tmp_path, namespaces, report_figure):
    pods = kube.pytorchjob_pods(secrets=secrets())
    master = next(p for p in pods if p.role == "master")
    # torchrun's convention, which collective follows: the chief listens on MASTER_PORT + 1.
    rnd = run_round(tmp_path, pods, master, {"grpc": {"port": int(master.env["MASTER_PORT"]) + 1}})

    assert rnd.probes == {"before": "UNAVAILABLE", "during": "SERVING", "after": "UNAVAILABLE"}, rnd.probes
    ranks = {p.name: int(p.env["RANK"]) for p in pods}
    summary = check_sync_round(rnd, pods, master, ranks)
    for p in pods:
        assert f"sync: rank {ranks[p.name]} of {len(pods)} " in rnd.logs[p.name], rnd.logs[p.name]
    report_figure(f"kubernetes PyTorchJob: master + {len(pods) - 1} workers, {summary['bytes']} bytes in "
                  f"{summary['seconds']:.3f} s (sync), {rnd.figure(master)}, digest {summary['workers'][0]['digest'][:16]}…")


@pytest.mark.parametrize("pods_of", [kube.tfjob_pods, kube.pytorchjob_pods], ids=["tfjob", "pytorchjob"])
def test_kubeflow_workers_ride_out_the_chiefs_name_not_resolving_until_its_pod_runs(tmp_path, namespaces, pods_of,
                                                                                   report_figure):
    pods = pods_of(secrets=secrets())
    chief = next(p for p in pods if p.role in ("chief", "master"))
    port = int(chief.env["MASTER_PORT"]) + 1 if "MASTER_PORT" in chief.env else int(
        json.loads(chief.env["TF_CONFIG"])["cluster"]["chief"][0].rsplit(":", 1)[1])
    rnd = run_round(tmp_path, pods, chief, {"grpc": {"port": port}}, late_name=True)
    assert rnd.codes == dict.fromkeys(rnd.codes, 0), "\n".join(f"--- {k}\n{v}" for k, v in rnd.logs.items())
    first = next(p for p in pods if p is not chief)
    # The first worker was told the name did not resolve, and retried until it did.
    assert re.search(r"not reachable yet .*(DNS|resolv|Name or service not known)", rnd.logs[first.name]), rnd.logs[first.name]
    digests = {json_line(rnd.logs[p.name])["digest"] for p in pods}
    assert len(digests) == 1, digests
    report_figure(f"kubernetes {pods_of.__name__.split('_')[0]} with the chief's name published late: "
                  f"{rnd.figure(chief)}")
