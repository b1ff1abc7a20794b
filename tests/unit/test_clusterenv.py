"""TF_CONFIG and torchrun variables -> the COLLECTIVE_* defaults they imply."""

from __future__ import annotations

import json

import pytest

from collective.clusterenv import (
    ClusterEnv,
    apply_defaults,
    apply_to_environ,
    from_environment,
    local_rank,
    role_mismatch,
)
from collective.errors import UsageError

CLUSTER = {"chief": ["chief-host:2222"], "worker": ["w0:2222", "w1:2222", "w2:2222"]}


def tf(task: dict | None, cluster: dict | None = None, **extra) -> dict[str, str]:
    config: dict = {"cluster": CLUSTER if cluster is None else cluster, **extra}
    if task is not None:
        config["task"] = task
    return {"TF_CONFIG": json.dumps(config)}


def torch(rank: object, world: object = 4, addr: object = "10.0.0.1", port: object = 29500) -> dict[str, str]:
    return {"MASTER_ADDR": str(addr), "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world)}


# --- TF_CONFIG ---------------------------------------------------------------------------


def test_tf_config_worker():
    env = from_environment(tf({"type": "worker", "index": 2}))
    assert env == ClusterEnv("worker", "chief-host:2222", 3, 2, "TF_CONFIG")
    assert apply_defaults(env, "worker") == {"COLLECTIVE_CHIEF": "chief-host:2222", "COLLECTIVE_RANK": "2"}
    assert env.describe() == "TF_CONFIG: worker 2 of 3, chief at chief-host:2222"


def test_tf_config_chief_binds_every_interface_on_the_chiefs_port():
    env = from_environment(tf({"type": "chief", "index": 0}))
    assert env == ClusterEnv("chief", "chief-host:2222", 3, None, "TF_CONFIG")
    assert apply_defaults(env, "chief") == {"COLLECTIVE_WORKERS": "3", "COLLECTIVE_BIND": "0.0.0.0:2222"}


def test_tf_config_chief_index_defaults_to_0_and_extra_keys_are_ignored():
    env = from_environment(tf({"type": "chief"}, environment="cloud", rpc_layer="grpc"))
    assert env.role == "chief" and env.worker_index is None


def test_tf_config_index_may_be_a_string_of_digits():
    assert from_environment(tf({"type": "worker", "index": "1"})).worker_index == 1


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({"task": {"type": "worker", "index": 0}}), "no 'cluster'"),
        (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}), "no 'chief' and 1 worker(s)"),
        (json.dumps({"cluster": {"chief": [], "worker": ["w:1"]}, "task": {"type": "chief"}}), "cluster.chief is empty"),
        (json.dumps({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "chief"}}), "only workers"),
        (json.dumps({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 2}}), "out of range"),
        (json.dumps({"cluster": {"chief": ["a:1", "b:1"], "worker": ["w:1"]}, "task": {"type": "chief"}}), "exactly one"),
        (json.dumps({"cluster": {"chief": "a:1", "worker": ["w:1"]}, "task": {"type": "chief"}}), "cluster.chief must be a list"),
        (json.dumps({"cluster": {"chief": ["a:1"]}, "task": {"type": "chief"}}), "cluster.worker must be a list"),
        (json.dumps({"cluster": {"chief": ["a:1"], "worker": []}, "task": {"type": "chief"}}), "cluster.worker is empty"),
        (json.dumps({"cluster": {"chief": ["chief-host"], "worker": ["w:1"]}, "task": {"type": "chief"}}), "is not HOST:PORT"),
        (json.dumps({"cluster": {"chief": ["a:0"], "worker": ["w:1"]}, "task": {"type": "chief"}}), "port 0"),
        (json.dumps({"cluster": CLUSTER}), "no 'task'"),
        (json.dumps({"cluster": CLUSTER, "task": {"type": "ps", "index": 0}}), "task type 'ps' is not chief or worker"),
        (json.dumps({"cluster": CLUSTER, "task": {"type": "worker"}}), "task index None is not a whole number"),
        (json.dumps({"cluster": CLUSTER, "task": {"type": "worker", "index": 3}}), "index 3 is out of range: cluster.worker lists 3"),
        (json.dumps({"cluster": CLUSTER, "task": {"type": "worker", "index": -1}}), "out of range"),
        (json.dumps({"cluster": CLUSTER, "task": {"type": "worker", "index": True}}), "not a whole number"),
        (json.dumps({"cluster": CLUSTER, "task": {"type": "chief", "index": 1}}), "index 1 is out of range: cluster.chief lists 1"),
    ],
)
def test_malformed_tf_config_is_a_usage_error_naming_tf_config_and_the_problem(value, problem):
    with pytest.raises(UsageError) as exc:
        from_environment({"TF_CONFIG": value})
    assert str(exc.value).startswith("TF_CONFIG")
    assert problem in str(exc.value)
    assert exc.value.exit_code == 2


def test_tf_config_without_chief_makes_worker_0_the_chief_and_it_trains():
    cluster = {"worker": ["w0:2222", "w1:2222", "w2:2222"]}
    env = from_environment(tf({"type": "worker", "index": 0}, cluster))
    assert env == ClusterEnv("chief", "w0:2222", 2, None, "TF_CONFIG", chief_trains=True)
    assert (env.rank, env.world_size) == (0, 3)
    assert apply_defaults(env, "chief") == {"COLLECTIVE_WORKERS": "2", "COLLECTIVE_BIND": "0.0.0.0:2222"}
    env = from_environment(tf({"type": "worker", "index": 2}, cluster))
    assert env == ClusterEnv("worker", "w0:2222", 2, 1, "TF_CONFIG", chief_trains=True)
    assert (env.rank, env.world_size) == (2, 3)
    assert "worker 0 is the chief" in role_mismatch(from_environment(tf({"type": "worker", "index": 0}, cluster)), "worker")


# --- torchrun ----------------------------------------------------------------------------


def test_torchrun_rank_0_is_the_chief():
    env = from_environment(torch(0))
    assert env == ClusterEnv("chief", "10.0.0.1:29501", 3, None, "torchrun", chief_trains=True)
    assert (env.rank, env.world_size) == (0, 4)
    assert apply_defaults(env, "chief") == {"COLLECTIVE_WORKERS": "3", "COLLECTIVE_BIND": "0.0.0.0:29501"}


def test_torchrun_rank_r_is_worker_r_minus_1():
    env = from_environment(torch(3))
    assert env == ClusterEnv("worker", "10.0.0.1:29501", 3, 2, "torchrun", chief_trains=True)
    assert (env.rank, env.world_size) == (3, 4)
    assert apply_defaults(env, "worker") == {"COLLECTIVE_CHIEF": "10.0.0.1:29501", "COLLECTIVE_RANK": "2"}


def test_torchrun_ipv6_master_addr_is_bracketed():
    env = from_environment(torch(0, addr="fd00::2"))
    assert env.chief_address == "[fd00::2]:29501"
    assert apply_defaults(env, "chief")["COLLECTIVE_BIND"] == "[::]:29501"


@pytest.mark.parametrize(
    ("env", "variable", "problem"),
    [
        (torch(0, port="http"), "MASTER_PORT", "not a whole number"),
        (torch(0, port=0), "MASTER_PORT", "out of range"),
        (torch(0, port=70000), "MASTER_PORT", "out of range"),
        (torch(0, port=65535), "MASTER_PORT", "the chief listens on MASTER_PORT+1"),
        (torch("zero"), "RANK", "not a whole number"),
        (torch(-1), "RANK", "out of range"),
        (torch(4, world=4), "RANK", "out of range: must be 0..3 for WORLD_SIZE=4"),
        (torch(0, world=1), "WORLD_SIZE", "the chief and at least one worker"),
        (torch(0, world="many"), "WORLD_SIZE", "not a whole number"),
        (torch(0, addr="bad host"), "MASTER_ADDR", "not a host name"),
        ({"MASTER_ADDR": "h", "RANK": "0", "WORLD_SIZE": "2"}, "MASTER_PORT", "not set"),
        ({"MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR", "not set"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "1"}, "WORLD_SIZE", "not set"),
    ],
)
def test_bad_torchrun_variables_are_usage_errors_naming_the_variable(env, variable, problem):
    with pytest.raises(UsageError) as exc:
        from_environment(env)
    assert f"torchrun variable {variable}" in str(exc.value)
    assert problem in str(exc.value)


def test_rank_and_world_size_alone_do_not_mean_torchrun():
    assert from_environment({"RANK": "0", "WORLD_SIZE": "4"}) is None


# --- neither, both, empty -----------------------------------------------------------------


def test_neither_gives_none():
    assert from_environment({}) is None
    assert from_environment({"COLLECTIVE_CHIEF": "h:1", "PATH": "/bin"}) is None


def test_empty_variables_count_as_unset():
    assert from_environment({"TF_CONFIG": "", "MASTER_ADDR": " ", "MASTER_PORT": ""}) is None


def test_tf_config_wins_over_torchrun():
    env = from_environment({**torch(0), **tf({"type": "worker", "index": 1})})
    assert env.source == "TF_CONFIG" and env.role == "worker"
    # ...also when the torchrun variables are bad: they are not read at all.
    assert from_environment({**torch("x"), **tf({"type": "worker", "index": 1})}).source == "TF_CONFIG"


def test_a_malformed_tf_config_does_not_fall_back_to_torchrun():
    with pytest.raises(UsageError, match="TF_CONFIG"):
        from_environment({**torch(0), "TF_CONFIG": "{"})


# --- roles and applying -------------------------------------------------------------------


def test_the_cluster_wide_values_hold_for_a_process_started_in_the_other_role():
    chief_env = from_environment(torch(0))
    assert apply_defaults(chief_env, "worker") == {"COLLECTIVE_CHIEF": "10.0.0.1:29501"}  # no rank to prefer
    assert role_mismatch(chief_env, "chief") is None
    warning = role_mismatch(chief_env, "worker")
    assert "torchrun makes this process the chief" in warning and "RANK" in warning
    assert "TF_CONFIG's task type" in role_mismatch(from_environment(tf({"type": "worker", "index": 0})), "chief")
    with pytest.raises(ValueError):
        apply_defaults(chief_env, "ps")


def test_apply_to_environ_sets_only_unset_or_empty_variables():
    environ = {**tf({"type": "worker", "index": 1}), "COLLECTIVE_CHIEF": "override:1", "COLLECTIVE_RANK": ""}
    env = apply_to_environ("worker", environ)
    assert env is not None and env.worker_index == 1
    assert environ["COLLECTIVE_CHIEF"] == "override:1"  # set by hand: kept
    assert environ["COLLECTIVE_RANK"] == "1"            # empty counts as unset
    environ = {}
    assert apply_to_environ("chief", environ) is None and environ == {}


def test_precedence_option_then_collective_variable_then_tf_config_then_default(monkeypatch):
    """Wired as intended (apply_to_environ before the parser is built), on the real parsers."""
    from collective.chief.__main__ import build_parser as chief_parser
    from collective.worker.__main__ import build_parser as worker_parser

    for name in ("COLLECTIVE_WORKERS", "COLLECTIVE_BIND", "COLLECTIVE_CHIEF", "COLLECTIVE_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.setenv(name, "")  # recorded, so whatever apply_to_environ sets is undone
        monkeypatch.delenv(name)
    monkeypatch.setenv("TF_CONFIG", tf({"type": "chief"})["TF_CONFIG"])
    apply_to_environ("chief")
    args = chief_parser().parse_args([])
    assert (args.workers, args.bind) == (3, "0.0.0.0:2222")                      # from TF_CONFIG
    assert chief_parser().parse_args(["--workers", "7"]).workers == 7            # option wins

    monkeypatch.setenv("COLLECTIVE_WORKERS", "5")
    monkeypatch.delenv("COLLECTIVE_BIND")
    apply_to_environ("chief")
    args = chief_parser().parse_args([])
    assert (args.workers, args.bind) == (5, "0.0.0.0:2222")                      # variable wins

    monkeypatch.setenv("TF_CONFIG", tf({"type": "worker", "index": 2})["TF_CONFIG"])
    apply_to_environ("worker")
    args = worker_parser().parse_args([])
    assert (args.chief, args.rank) == ("chief-host:2222", 2)
    assert worker_parser().parse_args(["--chief", "other:1"]).chief == "other:1"


@pytest.mark.parametrize("environ, expected", [
    ({}, 0),  # one process on its host
    ({"LOCAL_RANK": "2"}, 2),  # torchrun
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, 1),  # Open MPI
    ({"MPI_LOCALRANKID": "3"}, 3),  # MPICH / Intel MPI (Hydra)
    ({"SLURM_LOCALID": "1"}, 1),  # srun
    ({"COLLECTIVE_LOCAL_RANK": "0", "LOCAL_RANK": "5"}, 0),  # ours first
    ({"LOCAL_RANK": " ", "OMPI_COMM_WORLD_LOCAL_RANK": "4"}, 4),  # empty counts as unset
])
def test_local_rank_comes_from_the_launcher_that_started_the_process(environ, expected):
    assert local_rank(environ) == expected


@pytest.mark.parametrize("raw", ["x", "-1", "1.5"])
def test_a_bad_local_rank_is_a_usage_error_naming_the_variable(raw):
    with pytest.raises(UsageError, match=f"LOCAL_RANK={raw!r} is not a local rank"):
        local_rank({"LOCAL_RANK": raw})


# --- one resolver for every engine ----------------------------------------------------------------
#
# resolve_placement: explicit arguments > COLLECTIVE_* > TF_CONFIG > torchrun > PET_* > Kubeflow
# PyTorchJob > Slurm (an srun step) > MPI > a single process. Each row: the environment, then
# (rank, world size, local rank, node, nodes, chief, source).

from collective.clusterenv import (  # noqa: E402
    CLUSTER_VARS,
    PET_VARS,
    SINGLE,
    TORCHRUN_OWN_VARS,
    TORCHRUN_VARS,
    Placement,
    cluster_placement,
    resolve_placement,
    resolve_roles,
)

# srun -N 2 -n 4 in job 1234567: task 2, the first task of the second node.
SLURM = {"SLURM_JOB_ID": "1234567", "SLURM_STEP_ID": "0", "SLURM_PROCID": "2", "SLURM_NTASKS": "4",
         "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_JOB_NODELIST": "n[1-2]",
         "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NNODES": "2"}
SLURM_PORT = 20000 + 1234567 % 10000  # 24567
# Kubeflow Trainer v2 (JobSet) pod of node 1 of 2, one process per node, no torchrun.
PET = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1",
       "PET_MASTER_ADDR": "tj-node-0-0.tj", "PET_MASTER_PORT": "29400",
       "JOBSET_NAME": "tj", "REPLICATED_JOB_NAME": "node", "JOB_INDEX": "0", "JOB_COMPLETION_INDEX": "1"}
# Kubeflow PyTorchJob (training-operator v1): worker pod 0 = RANK 1 of 2 pods, `python train.py`.
PYTORCHJOB = {"MASTER_ADDR": "pj-master-0", "MASTER_PORT": "23456", "RANK": "1", "WORLD_SIZE": "2",
              "PET_NPROC_PER_NODE": "auto", "PET_NNODES": "2", "PET_NODE_RANK": "1", "PYTHONUNBUFFERED": "0"}
# torchrun --nnodes 2 --nproc-per-node 4: global rank 5 = local rank 1 on node 1.
TORCHRUN = {"MASTER_ADDR": "m", "MASTER_PORT": "29500", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "r1"}
TF_TASKS = json.dumps({"cluster": {"chief": ["c:1"], "worker": ["w0:1", "w0:2", "w1:1"]},
                       "task": {"type": "worker", "index": 2}})


def placed(env: dict[str, str], *args) -> tuple:
    p = resolve_placement(*args, env=env)
    return (p.rank, p.world_size, p.local_rank, p.node, p.nodes, p.chief, p.source)


@pytest.mark.parametrize(
    ("env", "want"),
    [
        # Slurm: srun's task; the chief is task 0 on the step's first node, port 20000 + job id % 10000
        (SLURM, (2, 4, 0, 1, 2, f"n1:{SLURM_PORT}", "Slurm")),
        ({**SLURM, "SLURM_PROCID": "0", "SLURM_NODEID": "0"}, (0, 4, 0, 0, 2, f"n1:{SLURM_PORT}", "Slurm")),
        ({**SLURM, "SLURM_PROCID": "3", "SLURM_LOCALID": "1"}, (3, 4, 1, 1, 2, f"n1:{SLURM_PORT}", "Slurm")),
        ({**SLURM, "COLLECTIVE_PORT": "31000"}, (2, 4, 0, 1, 2, "n1:31000", "Slurm")),
        ({**SLURM, "COLLECTIVE_PORT": "31000", "MASTER_PORT": "29500"}, (2, 4, 0, 1, 2, "n1:31000", "Slurm")),
        # MASTER_ADDR/MASTER_PORT exported in the batch script (no RANK): still Slurm, MASTER_PORT + 1
        ({**SLURM, "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}, (2, 4, 0, 1, 2, "n1:29501", "Slurm")),
        ({**SLURM, "SLURM_JOB_ID": "10000"}, (2, 4, 0, 1, 2, "n1:20000", "Slurm")),
        # srun -n 2 inside an allocation of 8 tasks: the step's count
        ({**SLURM, "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"},
         (1, 2, 0, 1, 2, f"n1:{SLURM_PORT}", "Slurm")),
        ({**SLURM, "SLURM_STEP_NODELIST": "gpu[001-002],cpu7", "SLURM_STEP_NUM_NODES": "3", "SLURM_NODEID": "2",
          "SLURM_NTASKS": "3", "SLURM_STEP_NUM_TASKS": "3"}, (2, 3, 0, 2, 3, f"gpu001:{SLURM_PORT}", "Slurm")),
        ({**SLURM, "SLURM_STEP_NODELIST": "rack[1-2]-node[01-02]", "SLURM_STEP_NUM_NODES": "4", "SLURM_NODEID": "3"},
         (2, 4, 0, 3, 4, f"rack1-node01:{SLURM_PORT}", "Slurm")),
        # no step node list: the job's
        ({k: v for k, v in SLURM.items() if k not in ("SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES")},
         (2, 4, 0, 1, 2, f"n1:{SLURM_PORT}", "Slurm")),
        # srun -n 1: one process, no chief
        ({**SLURM, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NODEID": "0",
          "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_NUM_NODES": "1"}, (0, 1, 0, 0, 1, None, "Slurm")),
        # srun --mpi=pmix / pmi2: the MPI variables agree with srun's, Slurm wins (no MPI round)
        ({**SLURM, "PMIX_RANK": "2"}, (2, 4, 0, 1, 2, f"n1:{SLURM_PORT}", "Slurm")),
        ({**SLURM, "PMI_RANK": "2", "PMI_SIZE": "4"}, (2, 4, 0, 1, 2, f"n1:{SLURM_PORT}", "Slurm")),
        # mpirun inside a step (its daemons are the step's tasks): MPI's rank disagrees, MPI places it
        ({**SLURM, "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
         (5, 8, 1, None, None, None, "MPI (OMPI_COMM_WORLD_RANK)")),
        # srun torchrun: torchrun's children carry the launcher task's SLURM_*; torchrun wins
        ({**SLURM, **TORCHRUN}, (5, 8, 1, 1, 2, "m:29501", "torchrun")),
        ({**SLURM, "TF_CONFIG": TF_TASKS}, (3, 4, 0, 2, 3, "c:1", "TF_CONFIG")),
        ({**SLURM, "COLLECTIVE_RANK": "1", "COLLECTIVE_WORLD_SIZE": "2", "COLLECTIVE_CHIEF": "h:9"},
         (1, 2, 0, None, None, "h:9", "COLLECTIVE_*")),
        # PET_* without torchrun (Trainer v2 / JobSet, one process per node)
        (PET, (1, 2, 0, 1, 2, "tj-node-0-0.tj:29401", "PET_*")),
        ({**PET, "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": ""}, (0, 2, 0, 0, 2, "tj-node-0-0.tj:29401", "PET_*")),
        ({**PET, "COLLECTIVE_PORT": "7000"}, (1, 2, 0, 1, 2, "tj-node-0-0.tj:7000", "PET_*")),
        ({**PET, "PET_NNODES": "1", "PET_NODE_RANK": "0"}, (0, 1, 0, 0, 1, None, "PET_*")),
        ({**PET, **SLURM}, (1, 2, 0, 1, 2, "tj-node-0-0.tj:29401", "PET_*")),  # PET_* before Slurm
        # Kubeflow PyTorchJob, one process per pod: RANK is the pod's index
        (PYTORCHJOB, (1, 2, 0, 1, 2, "pj-master-0:23457", "PyTorchJob")),
        ({**PYTORCHJOB, "RANK": "2", "WORLD_SIZE": "3", "PET_NNODES": "3", "PET_NODE_RANK": "2",
          "PET_NPROC_PER_NODE": "1"}, (2, 3, 0, 2, 3, "pj-master-0:23457", "PyTorchJob")),
        ({**PYTORCHJOB, "RANK": "0", "PET_NODE_RANK": "0"}, (0, 2, 0, 0, 2, "pj-master-0:23457", "PyTorchJob")),
        # torchrun (its own variables present): node GROUP_RANK, also inside a PyTorchJob / Trainer pod
        (TORCHRUN, (5, 8, 1, 1, 2, "m:29501", "torchrun")),
        ({**TORCHRUN, "GROUP_WORLD_SIZE": "", "PET_NNODES": "2"}, (5, 8, 1, 1, 2, "m:29501", "torchrun")),
        ({**PYTORCHJOB, "RANK": "3", "WORLD_SIZE": "8", "PET_NPROC_PER_NODE": "4", "LOCAL_RANK": "3",
          "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}, (3, 8, 3, None, 2, "pj-master-0:23457", "torchrun")),
        ({**PET, **TORCHRUN}, (5, 8, 1, 1, 2, "m:29501", "torchrun")),
        ({**TORCHRUN, "COLLECTIVE_PORT": "7000"}, (5, 8, 1, 1, 2, "m:7000", "torchrun")),
        ({**TORCHRUN, "COLLECTIVE_LOCAL_RANK": "0"}, (5, 8, 0, 1, 2, "m:29501", "torchrun")),
        (torch(1), (1, 4, 0, None, None, "10.0.0.1:29501", "torchrun")),  # plain MASTER_*/RANK/WORLD_SIZE
        # TF_CONFIG: node = this task's host among the distinct hosts (c, w0, w1)
        ({"TF_CONFIG": TF_TASKS}, (3, 4, 0, 2, 3, "c:1", "TF_CONFIG")),
        (tf({"type": "worker", "index": 1}, {"worker": ["a:1", "a:2", "b:1"]}), (1, 3, 0, 0, 2, "a:1", "TF_CONFIG")),
        # COLLECTIVE_*: node from a Kubernetes Indexed Job's pod index, unless JobSet has several Jobs
        ({"COLLECTIVE_RANK": "1", "COLLECTIVE_WORLD_SIZE": "2", "COLLECTIVE_CHIEF": "h:1", "JOB_COMPLETION_INDEX": "3"},
         (1, 2, 0, 3, None, "h:1", "COLLECTIVE_*")),
        ({"COLLECTIVE_RANK": "1", "COLLECTIVE_WORLD_SIZE": "2", "COLLECTIVE_CHIEF": "h:1", "JOB_COMPLETION_INDEX": "3",
          "JOB_INDEX": "1"}, (1, 2, 0, None, None, "h:1", "COLLECTIVE_*")),
        # MPI last
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
         (2, 3, 0, None, None, None, "MPI (OMPI_COMM_WORLD_RANK)")),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, (1, 2, 1, None, None, None, "MPI (PMI_RANK)")),
        ({}, (0, 1, 0, None, None, None, SINGLE)),
    ],
)
def test_one_resolver_places_the_process_from_the_first_engine_present(env, want):
    assert placed(env) == want
    assert resolve_roles(None, None, None, env) == resolve_placement(env=env)  # sync's name, the same


def test_the_placement_records_the_variables_it_read_and_describes_itself():
    p = resolve_placement(env={**SLURM, "HOME": "/root"})
    read = dict(p.variables)
    for name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NODEID",
                 "SLURM_STEP_NODELIST", "SLURM_JOB_ID"):
        assert read[name] == SLURM[name]
    assert "HOME" not in read and "SLURM_JOB_NODELIST" not in read  # read only what was used
    assert p.describe() == f"rank 2 of 4, local rank 0, node 1 of 2, chief at n1:{SLURM_PORT} (from Slurm)"
    assert "SLURM_STEP_NODELIST=n[1-2]" in p.report() and p.mpi is False and p.chief_trains is True
    assert isinstance(p, Placement)


def test_arguments_come_first_and_fill_in_what_they_give():
    assert placed(SLURM, 1, 2, "x:1") == (1, 2, 0, None, None, "x:1", "arguments")
    assert placed(SLURM, 3) == (3, 4, 0, 1, 2, f"n1:{SLURM_PORT}", "Slurm")  # rank only: the rest from Slurm
    assert placed({**SLURM, "COLLECTIVE_CHIEF": "other:7"}) == (2, 4, 0, 1, 2, "other:7", "Slurm")
    assert placed(PET, None, None, "c:5")[5] == "c:5"


def test_a_batch_script_without_srun_is_no_slurm_placement_and_the_note_says_so():
    batch = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2", "SLURM_PROCID": "0",
             "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    p = resolve_placement(env=batch)
    assert (p.rank, p.world_size, p.source) == (0, 1, SINGLE)
    assert "SLURM_JOB_ID=77 without an srun step" in p.note and "not a Slurm task placement" in p.note
    assert cluster_placement(batch) is None and from_environment(batch) is None
    assert resolve_placement(env={}).note == ""


@pytest.mark.parametrize(
    ("env", "needles"),
    [
        ({**SLURM, "SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": ""},
         ["Slurm variable SLURM_PROCID='4' is out of range: must be 0..3 for SLURM_NTASKS=4"]),
        ({**SLURM, "SLURM_PROCID": "4"}, ["SLURM_PROCID='4'", "for SLURM_STEP_NUM_TASKS=4"]),
        ({**SLURM, "SLURM_PROCID": "x"}, ["Slurm variable SLURM_PROCID='x' is not a whole number"]),
        ({**SLURM, "SLURM_NTASKS": "0", "SLURM_STEP_NUM_TASKS": ""}, ["SLURM_NTASKS='0' is out of range"]),
        ({**SLURM, "SLURM_NODEID": "2"},
         ["SLURM_NODEID=2 is out of range", "SLURM_STEP_NODELIST='n[1-2]' names 2 node(s)"]),
        ({**SLURM, "SLURM_NODEID": "-1"}, ["SLURM_NODEID='-1' is out of range"]),
        ({**SLURM, "SLURM_STEP_NODELIST": "n[1-"}, ["SLURM_STEP_NODELIST 'n[1-' is not a Slurm host list"]),
        ({**SLURM, "SLURM_STEP_NUM_NODES": "3"},
         ["SLURM_STEP_NUM_NODES=3 disagrees with SLURM_STEP_NODELIST='n[1-2]'", "2 node(s)"]),
        ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}, ["SLURM_JOB_ID is not set", "COLLECTIVE_PORT"]),
        ({**SLURM, "SLURM_JOB_ID": "abc"}, ["SLURM_JOB_ID='abc' is not a whole number"]),
        ({**SLURM, "COLLECTIVE_PORT": "0"}, ["COLLECTIVE_PORT='0' is out of range"]),
        ({**SLURM, "MASTER_PORT": "65535"}, ["MASTER_PORT='65535' is out of range", "MASTER_PORT+1"]),
        ({k: v for k, v in SLURM.items() if "NODELIST" not in k}, ["SLURM_PROCID=2", "SLURM_STEP_NUM_TASKS=4",
                                                                     "no node list", "srun"]),
        ({**PET, "PET_NODE_RANK": "2"}, ["PET variable PET_NODE_RANK='2' is out of range: must be 0..1 for PET_NNODES=2"]),
        ({**PET, "PET_NPROC_PER_NODE": "4"}, ["PET_NPROC_PER_NODE='4'", "not started by torchrun",
                                             "start the processes with torchrun"]),
        ({**PET, "PET_NPROC_PER_NODE": "auto"}, ["PET_NPROC_PER_NODE='auto'", "start the processes with torchrun"]),
        ({**PET, "PET_NNODES": "1:4"}, ["PET_NNODES='1:4' is an elastic range", "torchrun"]),
        ({**PET, "PET_MASTER_ADDR": ""}, ["PET variable PET_MASTER_ADDR is not set", "PET_NNODES=2"]),
        ({**PET, "PET_MASTER_PORT": "x"}, ["PET variable PET_MASTER_PORT='x' is not a whole number"]),
        ({**PET, "PET_NNODES": "0"}, ["PET_NNODES='0' is out of range"]),
        ({**PYTORCHJOB, "WORLD_SIZE": "8", "PET_NPROC_PER_NODE": "4"},
         ["PyTorchJob", "RANK=1", "WORLD_SIZE=8", "PET_NNODES=2", "PET_NPROC_PER_NODE=4", "not started by torchrun",
          "RANK is the pod's index", "start the processes with torchrun"]),
        ({**PYTORCHJOB, "WORLD_SIZE": "4"}, ["WORLD_SIZE=4 is not PET_NNODES=2", "start the processes with torchrun"]),
        ({**PYTORCHJOB, "PET_NNODES": "1:3"}, ["PET_NNODES='1:3' is an elastic range"]),
        ({**PYTORCHJOB, "PET_NODE_RANK": "0"}, ["PET_NODE_RANK=0 is not RANK=1"]),
        ({**PYTORCHJOB, "PET_NODE_RANK": "2"}, ["PET_NODE_RANK='2' is out of range: must be 0..1 for PET_NNODES=2"]),
        ({"MASTER_ADDR": "m", "MASTER_PORT": "29500", "RANK": "1"}, ["torchrun variable WORLD_SIZE is not set",
                                                                     "found MASTER_ADDR, MASTER_PORT, RANK"]),
        ({**TORCHRUN, "LOCAL_RANK": "4"},
         ["torchrun variable LOCAL_RANK='4' is out of range: must be 0..3 for LOCAL_WORLD_SIZE=4"]),
        ({**TORCHRUN, "GROUP_RANK": "2"}, ["torchrun variable GROUP_RANK='2' is out of range: must be 0..1"]),
        ({**TORCHRUN, "GROUP_WORLD_SIZE": "", "PET_NNODES": "2", "PET_NODE_RANK": "2"},
         ["PET_NODE_RANK='2' is out of range: must be 0..1 for PET_NNODES=2"]),
        ({**SLURM, "LOCAL_RANK": "", "SLURM_LOCALID": "x"}, ["SLURM_LOCALID='x' is not a local rank"]),
    ],
)
def test_half_set_or_conflicting_variables_are_one_line_usage_errors_naming_them(env, needles):
    with pytest.raises(UsageError) as exc:
        resolve_placement(env=env)
    message = str(exc.value)
    for needle in needles:
        assert needle in message
    assert "\n" not in message and exc.value.exit_code == 2


def test_an_engine_error_does_not_fall_through_to_a_lower_engine():
    # A bad Slurm value is reported even though MPI's variables would place the process.
    with pytest.raises(UsageError, match="SLURM_NODEID"):
        resolve_placement(env={**SLURM, "SLURM_NODEID": "9", "PMIX_RANK": "2"})


# --- the command lines: python -m collective.chief|worker from the new engines --------------------


@pytest.mark.parametrize(
    ("env", "source", "chief"),
    [(SLURM, "Slurm", f"n1:{SLURM_PORT}"), (PET, "PET_*", "tj-node-0-0.tj:29401"),
     (PYTORCHJOB, "PyTorchJob", "pj-master-0:23457"), (TORCHRUN, "torchrun", "m:29501")],
)
def test_rank_0_of_every_engine_is_the_chief_that_trains_and_the_others_its_workers(env, source, chief):
    rank_var = {"Slurm": "SLURM_PROCID", "PET_*": "PET_NODE_RANK", "PyTorchJob": "RANK", "torchrun": "RANK"}[source]
    first = {**env, rank_var: "0", **({"PET_NODE_RANK": "0"} if source == "PyTorchJob" else {}),
             **({"SLURM_NODEID": "0"} if source == "Slurm" else {})}
    chief_env = from_environment(first)
    world = resolve_placement(env=env).world_size
    assert chief_env == ClusterEnv("chief", chief, world - 1, None, source, chief_trains=True)
    assert chief_env.placement.rank == 0
    port = chief.rsplit(":", 1)[1]
    assert apply_defaults(chief_env, "chief") == {"COLLECTIVE_WORKERS": str(world - 1), "COLLECTIVE_BIND": f"0.0.0.0:{port}"}
    worker_env = from_environment(env)
    rank = resolve_placement(env=env).rank
    assert worker_env == ClusterEnv("worker", chief, world - 1, rank - 1, source, chief_trains=True)
    assert apply_defaults(worker_env, "worker") == {"COLLECTIVE_CHIEF": chief, "COLLECTIVE_RANK": str(rank - 1)}
    warning = role_mismatch(chief_env, "worker")
    assert f"{source} makes this process the chief" in warning and rank_var in warning


def test_a_single_process_placement_or_mpi_or_collective_vars_give_the_command_lines_nothing():
    one_task = {**SLURM, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NODEID": "0",
                "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_NUM_NODES": "1"}
    assert from_environment(one_task) is None
    assert from_environment({**PET, "PET_NNODES": "1", "PET_NODE_RANK": "0"}) is None
    assert from_environment({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}) is None
    assert from_environment({"COLLECTIVE_RANK": "1", "COLLECTIVE_WORLD_SIZE": "2"}) is None
    environ = dict(one_task)
    assert apply_to_environ("worker", environ) is None and environ == one_task


def test_srun_tasks_start_the_real_parsers_as_chief_and_worker(monkeypatch):
    """`srun -n 4 python -m collective.chief|worker`: task 0 serves 3 workers at the Slurm port."""
    from collective.chief.__main__ import build_parser as chief_parser
    from collective.worker.__main__ import build_parser as worker_parser

    for name in ("COLLECTIVE_WORKERS", "COLLECTIVE_BIND", "COLLECTIVE_CHIEF", "COLLECTIVE_RANK", "COLLECTIVE_PORT",
                 "TF_CONFIG", *TORCHRUN_VARS, *TORCHRUN_OWN_VARS, *PET_VARS, "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in {**SLURM, "SLURM_PROCID": "0", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(name, value)
    assert apply_to_environ("chief").describe() == f"Slurm: the chief (it trains too), at n1:{SLURM_PORT}, of 3 worker(s)"
    args = chief_parser().parse_args([])
    assert (args.workers, args.bind) == (3, f"0.0.0.0:{SLURM_PORT}")
    for name in ("COLLECTIVE_WORKERS", "COLLECTIVE_BIND"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NODEID", "1")
    apply_to_environ("worker")
    args = worker_parser().parse_args([])
    assert (args.chief, args.rank) == (f"n1:{SLURM_PORT}", 2)


def test_launch_keeps_every_engine_away_from_its_children():
    for name in ("TF_CONFIG", "MASTER_ADDR", "RANK", "WORLD_SIZE", "PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR",
                 "SLURM_PROCID", "SLURM_NTASKS"):
        assert name in CLUSTER_VARS
    # Without those, nothing places a launched child.
    assert cluster_placement({k: v for k, v in {**SLURM, **PET, **TORCHRUN}.items() if k not in CLUSTER_VARS}) is None


def test_doctor_shows_what_was_resolved_and_from_where():
    from collective.cli.doctor import local_checks

    checks = {c.name: c for c in local_checks({**SLURM, "SLURM_PROCID": "0", "SLURM_NODEID": "0"})}
    detail = checks["cluster env"].detail
    assert checks["cluster env"].ok is None
    assert detail.startswith(f"rank 0 of 4, local rank 0, node 0 of 2, chief at n1:{SLURM_PORT} (from Slurm); read ")
    for pair in ("SLURM_PROCID=0", "SLURM_NTASKS=4", "SLURM_STEP_NODELIST=n[1-2]", "SLURM_JOB_ID=1234567"):
        assert pair in detail
    batch = {c.name: c for c in local_checks({"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})}
    assert "without an srun step" in batch["cluster env"].detail
    bad = {c.name: c for c in local_checks({**PET, "PET_NPROC_PER_NODE": "8"})}
    assert bad["cluster env"].ok is False and bad["cluster env"].detail.startswith("PET_NPROC_PER_NODE='8'")
