"""deploy/kubernetes/*.yaml: every document validates, the validators are live, and what the
manifests wire together (ports, names, counts, ConfigMap files, roles) holds.

Validators:
* core kinds (ConfigMap, and every pod template, wrapped as the Job or Pod its controller makes
  of it) against Kubernetes' own OpenAPI schema, strict (an unknown field is an error, as with
  kubectl's default server-side field validation), by kubernetes-validate, for the oldest and the
  newest Kubernetes version we claim;
* the custom resources (JobSet, PyTorchJob, TFJob) against deploy/kubernetes/schemas/*.json,
  written from their CRDs, by jsonschema.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from collective import clusterenv
from collective.config import parse_address
from tests.multihost import kube

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
SCHEMAS = {
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset-v1alpha2.json",
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob-v1.json",
    ("kubeflow.org/v1", "TFJob"): "tfjob-v1.json",
}
# gRPC probes are GA from 1.27; the oldest release still maintained upstream, and the newest.
K8S_VERSIONS = ("1.30", "1.37")
MANIFESTS = {
    "jobset.yaml": ["ConfigMap", "Service", "JobSet"],
    "pytorchjob.yaml": ["ConfigMap", "PyTorchJob"],
    "tfjob.yaml": ["ConfigMap", "TFJob"],
}
SECRETS = {"collective-token": {"token": "t0ken"}}


def _core(doc: dict, where: str) -> list[str]:
    out = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            out.append(f"{where} (Kubernetes {version}): {'.'.join(map(str, exc.path))}: {exc.message}")
    return out


def _templates(doc: dict) -> list[tuple[str, dict]]:
    """The pod templates of a custom resource, as the objects its controller creates from them."""
    name, spec, out = doc["metadata"]["name"], doc["spec"], []
    if doc["kind"] == "JobSet":
        for rjob in spec.get("replicatedJobs") or []:
            meta = {"name": f"{name}-{rjob.get('name')}-0", **(rjob.get("template", {}).get("metadata") or {})}
            out.append((f"replicatedJobs[{rjob.get('name')}].template",
                        {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": rjob["template"].get("spec")}))
    else:
        field = "pytorchReplicaSpecs" if doc["kind"] == "PyTorchJob" else "tfReplicaSpecs"
        for rtype, replica in (spec.get(field) or {}).items():
            template = replica.get("template") or {}
            meta = {"name": f"{name}-{str(rtype).lower()}-0", **(template.get("metadata") or {})}
            out.append((f"{field}.{rtype}.template", {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template.get("spec")}))
    return out


def problems(doc: dict) -> list[str]:
    """Every validation error of one manifest document (empty: it is valid)."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in SCHEMAS:
        return _core(doc, f"{doc.get('kind')}")
    schema = json.loads((DEPLOY / "schemas" / SCHEMAS[key]).read_text())
    validator = jsonschema.Draft202012Validator(schema)
    out = [f"{doc['kind']}: {'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
    try:
        templates = _templates(doc)
    except (AttributeError, KeyError, TypeError) as exc:  # too broken to find the templates
        return out + [f"{doc['kind']}: no pod templates to check ({exc!r})"]
    for where, obj in templates:
        out += _core(obj, f"{doc['kind']} {where}")
    return out


def load(name: str) -> list[dict]:
    return kube.load(DEPLOY / name)


def test_the_schemas_are_valid_json_schemas():
    for path in sorted((DEPLOY / "schemas").glob("*.json")):
        jsonschema.Draft202012Validator.check_schema(json.loads(path.read_text()))
    assert sorted(p.name for p in (DEPLOY / "schemas").glob("*.json")) == sorted(SCHEMAS.values())


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_every_document_of_every_manifest_validates(name):
    docs = load(name)
    assert [d["kind"] for d in docs] == MANIFESTS[name]
    for doc in docs:
        assert problems(doc) == [], f"{name}: {doc['kind']} {doc['metadata']['name']}"


def _container(doc: dict, index: int = 0) -> dict:
    """The first container of the custom resource's ``index``-th pod template."""
    spec = doc["spec"]
    if doc["kind"] == "JobSet":
        return spec["replicatedJobs"][index]["template"]["spec"]["template"]["spec"]["containers"][0]
    field = "pytorchReplicaSpecs" if doc["kind"] == "PyTorchJob" else "tfReplicaSpecs"
    return list(spec[field].values())[index]["template"]["spec"]["containers"][0]


def _set(path: list, value):
    def mutate(doc: dict) -> None:
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return mutate


def _rename(path: list, old: str, new: str):
    def mutate(doc: dict) -> None:
        node = doc
        for key in path:
            node = node[key]
        node[new] = node.pop(old)
    return mutate


BROKEN = {
    # name: (file, document index, mutation, a piece of the expected error)
    "jobset: typo in a JobSet field": (
        "jobset.yaml", 2, _rename(["spec"], "replicatedJobs", "replicatedJob"), "'replicatedJob' was unexpected"),
    "jobset: replicas as a string": (
        "jobset.yaml", 2, _set(["spec", "replicatedJobs", 1, "replicas"], "1"), "'1' is not of type 'integer'"),
    "jobset: unknown success operator": (
        "jobset.yaml", 2, _set(["spec", "successPolicy", "operator"], "Every"), "'Every' is not one of"),
    "jobset: typo in a pod's env entry": (
        "jobset.yaml", 2, lambda d: _container(d, 1)["env"].append({"name": "X", "valu": "1"}), "'valu' was unexpected"),
    "jobset: probe port as a string": (
        "jobset.yaml", 2, lambda d: _container(d, 0)["readinessProbe"]["grpc"].__setitem__("port", "50051"),
        "'50051' is not of type 'integer'"),
    "jobset: container without a name": (
        "jobset.yaml", 2, lambda d: _container(d, 0).pop("name"), "'name' is a required property"),
    "pytorchjob: a replica type the operator does not know": (
        "pytorchjob.yaml", 1, _rename(["spec", "pytorchReplicaSpecs"], "Master", "Chief"), "'Chief' is not one of"),
    "pytorchjob: nprocPerNode as a number": (
        "pytorchjob.yaml", 1, _set(["spec", "nprocPerNode"], 1), "1 is not of type 'string'"),
    "pytorchjob: a cpu request of the wrong type": (
        "pytorchjob.yaml", 1, lambda d: _container(d, 1)["resources"]["requests"].__setitem__("cpu", [1]),
        "is not valid under any of the given schemas"),
    "tfjob: typo in the replica specs' name": (
        "tfjob.yaml", 1, _rename(["spec"], "tfReplicaSpecs", "tfReplicaSpec"), "'tfReplicaSpecs' is a required property"),
    "tfjob: unknown restart policy": (
        "tfjob.yaml", 1, _set(["spec", "tfReplicaSpecs", "Worker", "restartPolicy"], "Sometimes"), "'Sometimes' is not one of"),
    "tfjob: typo in a volume's ConfigMap reference": (
        "tfjob.yaml", 1,
        lambda d: d["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]["volumes"][0]["configMap"].__setitem__(
            "nmae", "x"), "'nmae' was unexpected"),
    "service: a port number as a string": (
        "jobset.yaml", 1, lambda d: d["spec"]["ports"][0].__setitem__("port", "50051"), "'50051' is not of type 'integer'"),
    "service: a typo in a field": (
        "jobset.yaml", 1, _rename(["spec"], "publishNotReadyAddresses", "publishNotReadyAddress"),
        "'publishNotReadyAddress' was unexpected"),
    "configmap: a data value that is not a string": (
        "tfjob.yaml", 0, _set(["data", "train.py"], 3), "3 is not of type 'string'"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_copy_fails_validation_naming_the_fault(case):
    name, index, mutate, expected = BROKEN[case]
    doc = copy.deepcopy(load(name)[index])
    assert problems(doc) == []
    mutate(doc)
    found = problems(doc)
    assert found, f"{case}: the broken copy validated"
    assert any(expected in p for p in found), found


# --- what the manifests wire together -------------------------------------------------------------


def _port_of(address: str) -> int:
    return parse_address(address, what="test")[1]


def test_jobset_counts_names_ports_and_files_agree(tmp_path):
    pods = kube.jobset_pods(secrets=SECRETS)
    chief = [p for p in pods if p.role == "chief"]
    workers = [p for p in pods if p.role == "workers"]
    assert len(chief) == 1 and workers
    chief = chief[0]
    js = kube.one(load("jobset.yaml"), "JobSet")
    for rjob in js["spec"]["replicatedJobs"]:
        job = rjob["template"]["spec"]
        # Every pod of a round must run at once: an index waiting for a slot would never join.
        assert job["parallelism"] == job["completions"], rjob["name"]
        assert job.get("completionMode") == "Indexed" and job.get("backoffLimit") == 0, rjob["name"]
    assert int(chief.env["COLLECTIVE_WORKERS"]) == len(workers)
    port = _port_of(chief.env["COLLECTIVE_BIND"])
    assert [p["containerPort"] for p in chief.container["ports"]] == [port]
    for kind in ("startup", "readiness", "liveness"):
        assert chief.probe(kind)["grpc"]["port"] == port, kind
    for w in workers:
        # The chief's name as the JobSet's headless Service publishes it, and its port.
        assert w.env["COLLECTIVE_CHIEF"] == f"{chief.dns_names[0]}:{port}"
        assert w.env["COLLECTIVE_RANK"] == w.env["JOB_COMPLETION_INDEX"] == str(w.index)
        assert w.env["COLLECTIVE_TOKEN"] == chief.env["COLLECTIVE_TOKEN"] == "t0ken"
    # The headless Service of the pods' subdomain: the name the workers dial, the chief's port.
    svc = kube.one(load("jobset.yaml"), "Service")
    assert svc["metadata"]["name"] == js["spec"].get("network", {}).get("subdomain", js["metadata"]["name"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"jobset.sigs.k8s.io/jobset-name": js["metadata"]["name"]}
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(port, chief.container["ports"][0]["name"])]
    model = Path(chief.env["COLLECTIVE_MODEL"])
    assert model.name in chief.files[str(model.parent)], chief.files
    from collective.sources import load_source  # the ConfigMap's spec is a valid model

    spec_file = tmp_path / model.name
    spec_file.write_text(chief.files[str(model.parent)][model.name])
    assert len(load_source(str(spec_file)).specs()) >= 1


@pytest.mark.parametrize("name, pods_of, container", [
    ("pytorchjob.yaml", kube.pytorchjob_pods, "pytorch"),
    ("tfjob.yaml", kube.tfjob_pods, "tensorflow"),
])
def test_kubeflow_jobs_run_the_configmaps_script_and_resolve_to_one_chief(name, pods_of, container):
    pods = pods_of(secrets=SECRETS)
    for p in pods:
        # The operator injects its variables into (and reads its port from) this container name.
        assert p.container["name"] == container
        assert p.argv[0] == "python"
        script = Path(p.argv[1])
        assert script.name in p.files[str(script.parent)], (p.name, p.files)
        compile(p.files[str(script.parent)][script.name], str(script), "exec")
    # What collective's resolver makes of each pod's environment: one chief, every other pod a
    # worker with its own index, all agreeing on the chief's address and the worker count.
    found = {p.name: clusterenv.from_environment(p.env) for p in pods}
    roles = [(env.role, env.worker_index) for env in found.values()]
    assert roles.count(("chief", None)) == 1, found
    assert sorted(i for r, i in roles if r == "worker") == list(range(len(pods) - 1)), found
    assert len({env.chief_address for env in found.values()}) == 1
    assert {env.num_workers for env in found.values()} == {len(pods) - 1}
    chief = next(p for p in pods if found[p.name].role == "chief")
    # The chief's port is declared on its container (tfjob-port, or MASTER_PORT + 1).
    declared = {port["containerPort"] for port in chief.container["ports"]}
    assert _port_of(found[chief.name].chief_address) in declared, declared
    assert found[chief.name].chief_address.split(":")[0] in chief.dns_names


def test_pytorchjob_world_size_counts_one_process_per_pod():
    job = kube.one(load("pytorchjob.yaml"), "PyTorchJob")
    # WORLD_SIZE is pods x nprocPerNode: the script runs one process per pod, so it must be "1".
    assert job["spec"]["nprocPerNode"] == "1"
    pods = kube.pytorchjob_pods(secrets=SECRETS)
    assert {p.env["WORLD_SIZE"] for p in pods} == {str(len(pods))}
    assert sorted(int(p.env["RANK"]) for p in pods) == list(range(len(pods)))


def test_the_helper_builds_env_by_kubernetes_rules():
    container = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        "env": [
            {"name": "A", "value": "a"},
            {"name": "B", "value": "$(A)-$(UNDEFINED)-$$(A)"},
            {"name": "IDX", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{kube.COMPLETION_INDEX}']"}}},
            {"name": "S", "valueFrom": {"secretKeyRef": {"name": "missing", "key": "k", "optional": True}}},
            {"name": "A", "value": "again"},
        ],
    }
    meta = {"name": "p", "namespace": "ns", "annotations": {kube.COMPLETION_INDEX: "4"}}
    env = kube.container_env(container, meta, configmaps={"cm": {"X": "1"}}, secrets={})
    assert env == {"CM_X": "1", "A": "again", "B": "a-$(UNDEFINED)-$(A)", "IDX": "4"}
    with pytest.raises(ValueError, match="does not exist"):
        kube.container_env({"name": "c", "env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]},
                           meta, configmaps={}, secrets={})


def test_the_manifests_parse_as_plain_yaml_documents():
    for name in MANIFESTS:
        text = (DEPLOY / name).read_text()
        assert "\t" not in text, name
        assert all(isinstance(d, dict) for d in yaml.safe_load_all(text) if d), name


def test_validation_needs_no_network(monkeypatch):
    """kubernetes-validate ships its schemas and jsonschema fetches no $ref: nothing connects."""
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError(f"validation tried to reach the network: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    for name in MANIFESTS:
        for doc in load(name):
            assert problems(doc) == [], name


@pytest.mark.parametrize("change, expected", [
    (lambda svc: svc["spec"].pop("clusterIP"), "is not headless"),
    (lambda svc: svc["spec"].__setitem__("publishNotReadyAddresses", False), "does not publish not-ready addresses"),
    (lambda svc: svc["spec"].__setitem__("selector", {"app": "other"}), "does not select pod"),
])
def test_the_harness_refuses_a_service_whose_names_would_not_resolve_as_emulated(tmp_path, change, expected):
    docs = load("jobset.yaml")
    change(kube.one(docs, "Service"))
    broken = tmp_path / "jobset.yaml"
    broken.write_text(yaml.safe_dump_all(docs))
    with pytest.raises(ValueError, match=expected):
        kube.jobset_pods(broken, secrets=SECRETS)
