"""The pods of deploy/kubernetes/*.yaml as their controllers would make them, for the netns runs.

Each ``*_pods`` function parses one manifest (``yaml.safe_load_all``) and returns one ``Pod`` per
pod the controller would create: its host name, the names other pods resolve it by, its
command, its files (ConfigMap volumes) and its environment, built by Kubernetes' own rules from
the manifest plus what the controllers add. So a change to a manifest changes what the tests run.

What each controller adds (and nothing else is added):

* JobSet (jobset.x-k8s.io/v1alpha2) with the Job controller: one Indexed Job per replicated job
  and job index, named ``<jobset>-<rjob>-<j>``; pod ``p`` of it has host name
  ``<jobset>-<rjob>-<j>-<p>``, subdomain ``spec.network.subdomain`` (default: the JobSet's name),
  the annotation and label ``batch.kubernetes.io/job-completion-index`` and the variable
  ``JOB_COMPLETION_INDEX`` (appended after the container's own), and JobSet's labels and
  annotations. The headless Service of the subdomain publishes not-ready addresses, so
  ``<host>.<subdomain>`` resolves from the first moment.
* training-operator PyTorchJob (kubeflow.org/v1): pods ``<job>-<type>-<i>``, each behind a headless
  Service of that name. Appended to every container: ``PYTHONUNBUFFERED=0``, then (with a Master)
  ``MASTER_PORT`` (the Master container ``pytorch``'s port ``pytorchjob-port``), ``MASTER_ADDR``
  (``<job>-master-0``), ``WORLD_SIZE`` (pods x nprocPerNode), ``RANK`` (worker i: i + 1),
  ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, then ``PET_NNODES`` (without an elasticPolicy).
* training-operator TFJob: pods ``<job>-<type>-<i>`` with a headless Service each; ``TF_CONFIG``
  appended to the container ``tensorflow``: ``{"cluster": {type: ["<job>-<type>-<i>.<ns>.svc:<port>"
  ...]}, "task": {"type": type, "index": i}, "environment": "cloud"}``, ports from
  ``tfjob-port``.

The container runtime's ``HOSTNAME`` (the pod's host name) comes first. Environment rules:
``envFrom`` before ``env``; ``value`` expands ``$(NAME)`` of variables defined before it;
``valueFrom`` reads ``fieldRef`` (name, namespace, labels, annotations), ``configMapKeyRef`` and
``secretKeyRef`` (the test passes the Secrets a user would create); a later duplicate wins, as in
the kubelet. Anything else raises ValueError naming it, so a manifest never silently means
something else here than in a cluster. The kubelet's service-link variables
(``KUBERNETES_SERVICE_HOST`` ...) are left out: nothing reads them.

``prepare`` sets this up in a ``Topology`` (tests/multihost/netns.py): each pod's UTS host name,
its hosts file (its own name, then every pod's names as the cluster DNS answers them, search path
expanded), and its ConfigMap volumes bind-mounted at their mount paths inside its mount namespace.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.multihost.netns import ETC_NETNS, Process, Topology

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
JOBSET = MANIFESTS / "jobset.yaml"
PYTORCHJOB = MANIFESTS / "pytorchjob.yaml"
TFJOB = MANIFESTS / "tfjob.yaml"
CLUSTER_DOMAIN = "cluster.local"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


def load(path: Path) -> list[dict]:
    """Every document of a manifest file (empty ones skipped)."""
    return [d for d in yaml.safe_load_all(Path(path).read_text()) if d]


def one(docs: Sequence[dict], kind: str) -> dict:
    found = [d for d in docs if d.get("kind") == kind]
    if len(found) != 1:
        raise ValueError(f"expected one {kind}, found {len(found)}")
    return found[0]


@dataclass
class Pod:
    """One pod as its controller makes it, and the one container that runs."""

    name: str          # the pod's (and its host's) name: <jobset>-<rjob>-<j>-<p>, <job>-<type>-<i>
    short: str         # the emulated host's name (at most 13 characters, see Topology)
    role: str          # the replicated job or replica type: chief, workers, master, worker
    index: int         # the pod's index in its role (completion index or replica index)
    own_names: tuple[str, ...]   # what this pod's own /etc/hosts names it (the kubelet's entry)
    dns_names: tuple[str, ...]   # what any pod resolves it by (the cluster DNS, search path expanded)
    argv: list[str]
    env: dict[str, str]
    files: dict[str, dict[str, str]]  # mount path -> file name -> content (ConfigMap volumes)
    container: dict
    metadata: dict = field(default_factory=dict)

    def probe(self, kind: str) -> dict | None:
        """The container's ``readinessProbe`` / ``livenessProbe`` / ``startupProbe`` (None: none)."""
        return self.container.get(f"{kind}Probe")


# --- Kubernetes' rules for a container's environment and command ------------------------------

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined variable is replaced, an undefined reference
    stays as written, ``$$`` is one ``$``."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _REF.sub(sub, text)


_FIELD = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def _field(path: str, meta: Mapping) -> str:
    if path == "metadata.name":
        return meta["name"]
    if path == "metadata.namespace":
        return meta["namespace"]
    m = _FIELD.match(path)
    if m:
        values = meta.get(m.group(1)) or {}
        if m.group(2) not in values:
            raise ValueError(f"fieldRef {path}: the pod has no such {m.group(1)[:-1]}")
        return values[m.group(2)]
    raise ValueError(f"fieldRef {path} is not emulated here")


def _keyed(kind: str, ref: Mapping, store: Mapping[str, Mapping[str, str]]) -> str | None:
    data = store.get(ref["name"])
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise ValueError(f"{kind} {ref['name']!r} key {ref['key']!r} does not exist (the pod would not start)")
    return str(data[ref["key"]])


def container_env(
    container: Mapping, meta: Mapping, *, configmaps: Mapping[str, Mapping[str, str]],
    secrets: Mapping[str, Mapping[str, str]], base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A container's environment by the kubelet's rules: ``base`` (the runtime's), ``envFrom``,
    then ``env``."""
    env = dict(base or {})
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            kind, ref, store = "ConfigMap", source["configMapRef"], configmaps
        elif "secretRef" in source:
            kind, ref, store = "Secret", source["secretRef"], secrets
        else:
            raise ValueError(f"envFrom {source} is not emulated here")
        if ref["name"] not in store:
            if ref.get("optional"):
                continue
            raise ValueError(f"envFrom: {kind} {ref['name']!r} does not exist")
        env.update({prefix + k: str(v) for k, v in store[ref["name"]].items()})
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" in var:
            source = var["valueFrom"]
            if "fieldRef" in source:
                value = _field(source["fieldRef"]["fieldPath"], meta)
            elif "configMapKeyRef" in source:
                value = _keyed("ConfigMap", source["configMapKeyRef"], configmaps)
            elif "secretKeyRef" in source:
                value = _keyed("Secret", source["secretKeyRef"], secrets)
            else:
                raise ValueError(f"env {name}: valueFrom {source} is not emulated here")
            if value is None:
                continue
        else:
            value = expand(str(var.get("value", "")), env)
        env[name] = value
    return env


def container_argv(container: Mapping, env: Mapping[str, str]) -> list[str]:
    if not container.get("command"):
        raise ValueError(f"container {container['name']}: no command (the image's entrypoint is not emulated)")
    return [expand(str(a), env) for a in [*container["command"], *(container.get("args") or [])]]


def volume_files(pod_spec: Mapping, container: Mapping, configmaps: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, str]]:
    """Mount path -> the files a ConfigMap volume puts there (all keys, or its ``items``)."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    out = {}
    for mount in container.get("volumeMounts") or []:
        volume = volumes[mount["name"]]
        if "configMap" not in volume or "subPath" in mount:
            raise ValueError(f"volume {mount['name']}: only whole ConfigMap volumes are emulated")
        data = configmaps[volume["configMap"]["name"]]
        items = volume["configMap"].get("items")
        out[mount["mountPath"]] = {i["path"]: data[i["key"]] for i in items} if items else dict(data)
    return out


def _configmaps(docs: Sequence[dict]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: dict(d.get("data") or {}) for d in docs if d.get("kind") == "ConfigMap"}


def _container(pod_spec: Mapping, name: str | None = None) -> dict:
    containers = pod_spec["containers"]
    if name is None:
        if len(containers) != 1:
            raise ValueError("only one container per pod is emulated")
        return containers[0]
    found = [c for c in containers if c["name"] == name]
    if not found:
        raise ValueError(f"no container named {name!r} (the operator looks for that name)")
    return found[0]


def _pod(name, short, role, index, own, dns, meta, template, container, configmaps, secrets, added) -> Pod:
    env = container_env(container, meta, configmaps=configmaps, secrets=secrets, base={"HOSTNAME": name})
    for key, value in added:  # what the controller appends to the container's env
        env[key] = value
    return Pod(name=name, short=short, role=role, index=index, own_names=own, dns_names=dns,
               argv=container_argv(container, env), env=env,
               files=volume_files(template["spec"], container, configmaps), container=container, metadata=meta)


# --- JobSet ----------------------------------------------------------------------------------------


def jobset_pods(path: Path = JOBSET, *, namespace: str = "default",
                secrets: Mapping[str, Mapping[str, str]] | None = None) -> list[Pod]:
    docs = load(path)
    js = one(docs, "JobSet")
    configmaps = _configmaps(docs)
    name = js["metadata"]["name"]
    network = js["spec"].get("network") or {}
    if network.get("enableDNSHostnames") is False:
        raise ValueError("enableDNSHostnames is false: the pods would have no stable names")
    subdomain = network.get("subdomain") or name
    # The subdomain's Service: the manifest's own if it declares one (JobSet then makes none),
    # else JobSet's (headless, selecting the JobSet's pods, not-ready addresses published unless
    # network.publishNotReadyAddresses is false). The harness resolves every name from the start.
    services = [d for d in docs if d.get("kind") == "Service" and d["metadata"]["name"] == subdomain]
    svc = services[0]["spec"] if services else {
        "clusterIP": "None", "selector": {"jobset.sigs.k8s.io/jobset-name": name},
        "publishNotReadyAddresses": network.get("publishNotReadyAddresses", True)}
    if svc.get("clusterIP") != "None":
        raise ValueError(f"Service {subdomain} is not headless: the pods would have no DNS records of their own")
    if not svc.get("publishNotReadyAddresses"):
        raise ValueError(f"Service {subdomain} does not publish not-ready addresses: names would not resolve "
                         "before the pods are Ready (not emulated here)")
    pods = []
    for rjob in js["spec"]["replicatedJobs"]:
        job_spec = rjob["template"]["spec"]
        template = job_spec["template"]
        if job_spec.get("completionMode", "Indexed") != "Indexed":
            raise ValueError(f"replicated job {rjob['name']}: only Indexed Jobs have stable pod names")
        container = _container(template["spec"])
        for j in range(rjob.get("replicas", 1)):
            for p in range(job_spec.get("completions", job_spec.get("parallelism", 1))):
                host = f"{name}-{rjob['name']}-{j}-{p}"
                fqdn = f"{host}.{subdomain}.{namespace}.svc.{CLUSTER_DOMAIN}"
                meta = {
                    "name": f"{host}-x7k2q",  # the Job controller's generated suffix
                    "namespace": namespace,
                    "labels": {**(template.get("metadata") or {}).get("labels", {}),
                               "jobset.sigs.k8s.io/jobset-name": name,
                               "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                               "jobset.sigs.k8s.io/job-index": str(j),
                               "jobset.sigs.k8s.io/restart-attempt": "0",
                               COMPLETION_INDEX: str(p)},
                    "annotations": {**(template.get("metadata") or {}).get("annotations", {}),
                                    "jobset.sigs.k8s.io/jobset-name": name,
                                    "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                                    "jobset.sigs.k8s.io/replicatedjob-replicas": str(rjob.get("replicas", 1)),
                                    "jobset.sigs.k8s.io/job-index": str(j),
                                    COMPLETION_INDEX: str(p)},
                }
                selector = svc.get("selector") or {}
                if any(meta["labels"].get(k) != v for k, v in selector.items()):
                    raise ValueError(f"Service {subdomain}'s selector {selector} does not select pod {host}")
                pods.append(_pod(
                    host, f"{rjob['name'][:7]}-{j}-{p}", rjob["name"], p, (fqdn, host),
                    (f"{host}.{subdomain}", f"{host}.{subdomain}.{namespace}", f"{host}.{subdomain}.{namespace}.svc", fqdn),
                    meta, template, container, configmaps, secrets or {},
                    [("JOB_COMPLETION_INDEX", str(p))],
                ))
    return pods


# --- the training-operator's PyTorchJob and TFJob ---------------------------------------------------


def _replica_meta(job: str, rtype: str, i: int, namespace: str, template: Mapping, role: str | None) -> dict:
    labels = {**(template.get("metadata") or {}).get("labels", {}),
              "training.kubeflow.org/job-name": job,
              "training.kubeflow.org/replica-type": rtype.lower(),
              "training.kubeflow.org/replica-index": str(i)}
    if role:
        labels["training.kubeflow.org/job-role"] = role
    return {"name": f"{job}-{rtype.lower()}-{i}", "namespace": namespace, "labels": labels,
            "annotations": dict((template.get("metadata") or {}).get("annotations", {}))}


def _service_names(pod: str, namespace: str) -> tuple[str, ...]:
    return (pod, f"{pod}.{namespace}", f"{pod}.{namespace}.svc", f"{pod}.{namespace}.svc.{CLUSTER_DOMAIN}")


def _port(template: Mapping, container: str, port_name: str, default: int) -> int:
    for c in template["spec"]["containers"]:
        if c["name"] == container:
            for p in c.get("ports") or []:
                if p.get("name") == port_name:
                    return int(p["containerPort"])
    return default


def pytorchjob_pods(path: Path = PYTORCHJOB, *, namespace: str = "default",
                    secrets: Mapping[str, Mapping[str, str]] | None = None) -> list[Pod]:
    docs = load(path)
    job = one(docs, "PyTorchJob")
    configmaps = _configmaps(docs)
    name, spec = job["metadata"]["name"], job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    if "Master" not in replicas:
        raise ValueError("no Master replica: the operator would set no MASTER_ADDR / RANK")
    if spec.get("elasticPolicy") is not None:
        raise ValueError("elasticPolicy is not emulated here")
    nproc = spec.get("nprocPerNode", "auto")
    total = sum(int(r.get("replicas", 1)) for r in replicas.values())
    world = total * (int(nproc) if str(nproc).isdigit() else 1)
    master_port = _port(replicas["Master"]["template"], "pytorch", "pytorchjob-port", -1)
    if master_port < 0:
        raise ValueError("the Master's container 'pytorch' has no port 'pytorchjob-port' (the operator fails the job)")
    pods = []
    for rtype in ("Master", "Worker"):
        if rtype not in replicas:
            continue
        template = replicas[rtype]["template"]
        container = _container(template["spec"], "pytorch")
        for i in range(int(replicas[rtype].get("replicas", 1))):
            rank = i + 1 if rtype == "Worker" else i
            meta = _replica_meta(name, rtype, i, namespace, template, "master" if rtype == "Master" else None)
            added = [("PYTHONUNBUFFERED", "0"), ("MASTER_PORT", str(master_port)), ("MASTER_ADDR", f"{name}-master-0"),
                     ("WORLD_SIZE", str(world)), ("RANK", str(rank)), ("PET_NPROC_PER_NODE", str(nproc)),
                     ("PET_NODE_RANK", str(rank)), ("PET_NNODES", str(total))]
            pods.append(_pod(meta["name"], f"{rtype.lower()}-{i}", rtype.lower(), i, (meta["name"],),
                             _service_names(meta["name"], namespace), meta, template, container, configmaps,
                             secrets or {}, added))
    return pods


TF_TYPES = ("Chief", "Master", "Worker", "PS", "Evaluator")


def tfjob_pods(path: Path = TFJOB, *, namespace: str = "default",
               secrets: Mapping[str, Mapping[str, str]] | None = None) -> list[Pod]:
    docs = load(path)
    job = one(docs, "TFJob")
    configmaps = _configmaps(docs)
    name, replicas = job["metadata"]["name"], job["spec"]["tfReplicaSpecs"]
    cluster = {}
    for rtype in TF_TYPES:
        if rtype in replicas:
            port = _port(replicas[rtype]["template"], "tensorflow", "tfjob-port", 2222)
            cluster[rtype.lower()] = [f"{name}-{rtype.lower()}-{i}.{namespace}.svc:{port}"
                                      for i in range(int(replicas[rtype].get("replicas", 1)))]
    pods = []
    for rtype in TF_TYPES:
        if rtype not in replicas:
            continue
        template = replicas[rtype]["template"]
        container = _container(template["spec"], "tensorflow")
        for i in range(int(replicas[rtype].get("replicas", 1))):
            # Go's json.Marshal: struct fields in declaration order, map keys sorted.
            tf_config = {"cluster": dict(sorted(cluster.items())), "task": {"type": rtype.lower(), "index": i},
                         "environment": "cloud"}
            meta = _replica_meta(name, rtype, i, namespace, template, "master" if rtype in ("Chief", "Master") else None)
            pods.append(_pod(meta["name"], f"{rtype.lower()}-{i}", rtype.lower(), i, (meta["name"],),
                             _service_names(meta["name"], namespace), meta, template, container, configmaps,
                             secrets or {}, [("TF_CONFIG", json.dumps(tf_config, separators=(",", ":")))]))
    return pods


# --- running the pods in network namespaces ---------------------------------------------------------


def _hosts_line(net: Topology, pod: Pod, names: Sequence[str]) -> str:
    return f"{net.hosts[pod.short].address}\t{' '.join(names)}\n"


def _append_hosts(net: Topology, pod: Pod, text: str) -> None:
    # Appended in place: the host's /etc/hosts is a bind mount of this very file.
    with open(ETC_NETNS / net.hosts[pod.short].ns / "hosts", "a") as f:
        f.write(text)


def prepare(net: Topology, pods: Sequence[Pod], workdir: Path, *, withheld: Sequence[Pod] = ()) -> None:
    """Make each emulated host the pod: its host name, its hosts file (every pod's names resolve
    from the start, before anything listens: the headless Services publish not-ready addresses),
    its ConfigMap volumes at their mount paths (a bind mount in the pod's own mount namespace).

    ``withheld``: pods whose names the others cannot resolve yet (a Service that publishes a pod
    only once it is Ready); ``publish`` adds them later. A pod always resolves its own name."""
    for pod in pods:
        done = net.exec(pod.short, ["hostname", pod.name])
        if done.returncode != 0:
            raise RuntimeError(f"hostname {pod.name} on {pod.short}: {done.stderr}")
    cluster = "".join(_hosts_line(net, p, p.dns_names) for p in pods if p not in withheld)
    for pod in pods:
        _append_hosts(net, pod, _hosts_line(net, pod, pod.own_names) + cluster)
        for mount_path, files in pod.files.items():
            target = Path(mount_path)
            if not target.parent.is_dir() or target.parent == Path("/"):
                raise RuntimeError(f"{pod.name}: cannot emulate the volume at {mount_path}: {target.parent} must be an existing directory")
            # Over the parent directory, inside the pod's mount namespace only: the pod sees
            # <parent>/<name>/<files>, the machine sees nothing.
            staged = workdir / "volumes" / pod.short
            (staged / target.name).mkdir(parents=True, exist_ok=True)
            for fname, content in files.items():
                (staged / target.name / fname).write_text(content)
            done = net.exec(pod.short, ["mount", "--bind", str(staged), str(target.parent)])
            if done.returncode != 0:
                raise RuntimeError(f"{pod.name}: mount of {mount_path}: {done.stderr}")


def publish(net: Topology, pod: Pod, pods: Sequence[Pod]) -> None:
    """Make a withheld pod's names resolve from every other pod (its Service's endpoints appear)."""
    for other in pods:
        if other is not pod:
            _append_hosts(net, other, _hosts_line(net, pod, pod.dns_names))


def run(net: Topology, pod: Pod) -> Process:
    """Start the pod's container on its host: exactly its command and its environment."""
    return net.run(pod.short, pod.argv, env=pod.env, name=pod.name)


_HEALTH = (
    "import grpc, json, sys\n"
    "from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g\n"
    "try:\n"
    "    r = g.HealthStub(grpc.insecure_channel(sys.argv[1])).Check(h.HealthCheckRequest(service=sys.argv[2]), timeout=2)\n"
    "    print(h.HealthCheckResponse.ServingStatus.Name(r.status))\n"
    "except grpc.RpcError as exc:\n"
    "    print(exc.code().name)\n"
)


def grpc_probe(net: Topology, from_host: str, address: str, probe: Mapping) -> str:
    """What a kubelet's ``grpc:`` probe sees, asked from ``from_host``: the serving status
    (SERVING, NOT_SERVING ...) or the gRPC error code (UNAVAILABLE: nothing listens)."""
    grpc_probe_spec = probe["grpc"]
    target = f"{address}:{int(grpc_probe_spec['port'])}"
    done = net.exec(from_host, ["python", "-c", _HEALTH, target, grpc_probe_spec.get("service", "")])
    if done.returncode != 0:
        raise RuntimeError(f"health probe of {target} failed to run: {done.stderr}")
    return done.stdout.strip()


def describe(pod: Pod) -> str:
    """One line for failure messages: the pod, its command and its environment."""
    return f"{pod.name}: {shlex.join(pod.argv)} with {json.dumps(pod.env, sort_keys=True)}"
