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
