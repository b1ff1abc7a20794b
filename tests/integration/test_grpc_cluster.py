"""Real chief and worker processes over gRPC on loopback."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from tests.procs import ROOT, wait_for

pytestmark = pytest.mark.integration

FAST = ["--join-timeout", "20"]



def launch_json(tmp_path, *args: str, timeout: float = 90) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "collective.cli", "launch", "--json", "--quiet", "--run-dir", str(tmp_path / "run"),
         "--join-timeout", "30", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL,
    )
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "{}"
    return proc.returncode, json.loads(last), proc.stderr


def digest(a: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(a).tobytes())


def test_launch_with_a_two_device_worker_names_replicas_and_every_digest_matches_the_model(tmp_path):
    from collective.sources import load_source

    code, result, err = launch_json(tmp_path, "--workers", "2", "--devices-per-worker", "2")
    assert code == 0, err
    assert result["ok"] is True and result["transport"] == "grpc"
    source = load_source("mlp")
    expected = {}
    for spec in source.specs():
        out = np.empty(spec.shape, spec.np_dtype)
        source.fill(spec, out)
        expected[spec.name] = digest(out)
    assert {v["name"]: v["digest"] for v in result["variables"]} == expected
    assert result["bytes"] >= sum(s.nbytes for s in source.specs())
    assert [w["rank"] for w in result["workers"]] == [0, 1]
    for w in result["workers"]:
        assert w["devices"] == ["cpu:0", "cpu:1"]
        names = [s.name for s in source.specs()]
        assert w["replicas"] == 2 * len(names)  # launch counts them; the names are checked in test_replicas
    assert len({w["digest"] for w in result["workers"]}) == 1
    assert {v["group_key"] for v in result["variables"]} == {1}
    assert sorted(v["instance_key"] for v in result["variables"]) == list(range(1, len(expected) + 1))
    assert result["seconds"] > 0
    # Every process kept its own log in the run directory.
    assert {p.name for p in (tmp_path / "run").glob("*.log")} == {"chief.log", "worker-0.log", "worker-1.log"}
    assert "training started" in (tmp_path / "run" / "worker-1.log").read_text()


@pytest.mark.parametrize("kind", ["npz", "safetensors"])
def test_checkpoint_files_reach_every_worker_bit_exact(tmp_path, kind):
    rng = np.random.default_rng(7)
    arrays = {
        "layer.0/weight": rng.standard_normal((40, 30)).astype(np.float32),
        "layer.0/bias": np.zeros(30, np.float64),
        "embed": rng.integers(-100, 100, (50, 8)).astype(np.int8),
        "step": np.array(12, np.int64),
    }
    path = tmp_path / f"model.{kind}"
    if kind == "npz":
        np.savez(path, **arrays)
    else:
        from safetensors.numpy import save_file

        save_file(arrays, str(path))
    code, result, err = launch_json(tmp_path, "--workers", "2", "--model", str(path))
    assert code == 0, err
    assert {v["name"]: v["digest"] for v in result["variables"]} == {k: digest(a) for k, a in arrays.items()}
    assert {v["name"]: v["shape"] for v in result["variables"]} == {k: list(a.shape) for k, a in arrays.items()}


def test_missing_worker_is_named_by_the_chief_and_the_joined_worker_after_the_join_timeout(cluster):
    chief = cluster.chief("--workers", "2", "--join-timeout", "2")
    worker = cluster.worker("only-one", "--join-timeout", "30")
    assert chief.wait(30) != 0
    assert worker.wait(30) != 0
    assert "1/2 workers joined" in chief.output() and "only-one" in chief.output()
    assert "1/2 workers joined" in worker.output()
    for p in (chief, worker):
        assert "Traceback" not in p.output()
        assert "training started" not in p.output()


def test_a_wrong_token_is_refused_and_the_chief_goes_on_serving_the_right_workers(cluster):
    chief = cluster.chief("--workers", "1", *FAST, env={"COLLECTIVE_TOKEN": "right-secret"})
    intruder = cluster.worker("intruder", "--token", "wrong-secret", *FAST)
    assert intruder.wait(30) != 0
    assert "refused the cluster token" in intruder.output()
    good = cluster.worker("good", *FAST, env={"COLLECTIVE_TOKEN": "right-secret"})
    assert good.wait(60) == 0, good.output()
    assert chief.wait(30) == 0, chief.output()
    assert "refused Join from ipv4:127.0.0.1" in chief.output()
    assert "wrong-secret" not in chief.output() and "right-secret" not in chief.output()
    assert "training started" in good.output()


def test_a_missing_token_is_refused_too(cluster):
    cluster.chief("--workers", "1", *FAST, env={"COLLECTIVE_TOKEN": "s3cret"})
    anonymous = cluster.worker("anonymous", *FAST)
    assert anonymous.wait(30) != 0
    assert "refused the cluster token" in anonymous.output()


def test_a_corrupt_model_file_ends_the_chief_with_exit_2_and_one_line(tmp_path, cluster):
    bad = tmp_path / "broken.npz"
    bad.write_bytes(b"PK\x03\x04 this is not a zip archive")
    chief = cluster.chief("--workers", "1", "--model", str(bad), wait_port=False)
    assert chief.wait(30) == 2
    out = chief.output()
    assert "broken.npz" in out and "Traceback" not in out
    assert len([ln for ln in out.splitlines() if ln.strip()]) == 1


def _sparse_safetensors(path, nbytes: int):
    raw = json.dumps({"w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    with open(path, "wb") as fh:  # a hole, not 48 GiB of disk
        fh.write(len(raw).to_bytes(8, "little") + raw)
        fh.truncate(8 + len(raw) + nbytes)
    return path


@pytest.mark.parametrize("bomb", ["spec", "sparse-safetensors"])
def test_a_model_bigger_than_memory_ends_the_chief_with_exit_2_before_allocating(tmp_path, cluster, bomb):
    if bomb == "spec":  # 100 bytes that ask for 3.6 TiB: more than the memory available anywhere
        model = tmp_path / "bomb.json"
        model.write_text('{"variables": [{"name": "w", "shape": [1000000, 1000000], "dtype": "float32", '
                         '"initializer": "zeros"}]}')
        env, says = {}, "bomb.json: variable 'w' is [1000000, 1000000] float32 = 3.6 TiB, more than the"
    else:  # a consistent 48 GiB file, refused against the limit in the environment
        model = _sparse_safetensors(tmp_path / "model.safetensors", 48 << 30)
        env = {"COLLECTIVE_MAX_MODEL_BYTES": "1GiB"}
        says = "model.safetensors: variable 'w' is [51539607552] uint8 = 48.0 GiB, more than --max-model-bytes 1.0 GiB"
    chief = cluster.chief("--workers", "1", "--model", str(model), env=env, wait_port=False)
    assert chief.wait(60) == 2
    lines = [ln for ln in chief.output().splitlines() if ln.strip()]
    assert len(lines) == 1 and says in lines[0], lines


@pytest.mark.parametrize(
    ("names", "says"),
    [('"a\\ud800"', "variable 'a\\ud800': the name is not valid Unicode text"),
     ('"x", "x/replica_1"', "variable 'x/replica_1' is named like replica 1 of variable 'x'")],
)
def test_a_model_whose_names_cannot_go_on_the_wire_ends_the_chief_with_exit_2(tmp_path, cluster, names, says):
    entries = ", ".join(
        f'{{"name": {n}, "shape": [1], "dtype": "float32", "initializer": "zeros"}}' for n in names.split(", ")
    )
    model = tmp_path / "names.json"
    model.write_text(f'{{"variables": [{entries}]}}')
    chief = cluster.chief("--workers", "1", "--model", str(model), wait_port=False)
    assert chief.wait(30) == 2
    lines = [ln for ln in chief.output().splitlines() if ln.strip()]
    assert len(lines) == 1 and f"names.json: {says}" in lines[0], lines


def test_an_invalid_option_exits_2_without_a_traceback(cluster):
    chief = cluster.chief("--workers", "0", wait_port=False)
    assert chief.wait(30) == 2
    assert "--workers" in chief.output() and "Traceback" not in chief.output()


def test_a_port_in_use_ends_the_chief_with_exit_2_and_one_line_naming_it(cluster):
    # Before: gRPC's C-core log line ("add_port.cc ... Failed to add port") and a message that
    # pointed at GRPC_VERBOSITY.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        from tests.procs import Proc

        chief = Proc(["-m", "collective.chief", "--workers", "1", "--bind", f"127.0.0.1:{port}"], cluster.tmp / "chief.log")
        cluster.procs.append(chief)
        assert chief.wait(30) == 2
    errors = [ln for ln in chief.output().splitlines() if " INFO " not in ln and ln.strip()]
    assert errors == [errors[0]] and errors[0].endswith(
        f"cannot listen on 127.0.0.1:{port}: the port is in use (another chief or relay?); "
        f"pick another port or stop that process"), errors


def test_an_unreachable_chief_is_named_by_the_worker(cluster):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = cluster.worker("lonely", "--join-timeout", "1.5", chief=f"127.0.0.1:{port}")
    assert worker.wait(30) != 0
    assert f"chief at 127.0.0.1:{port} unreachable" in worker.output()
    assert "Traceback" not in worker.output()


def test_a_chief_killed_while_workers_wait_is_named_by_them(cluster):
    hb = ["--heartbeat-interval", "0.3", "--heartbeat-timeout", "1.5"]
    chief = cluster.chief("--workers", "2", *hb)
    worker = cluster.worker("waiting", *hb)
    wait_for(worker, "waiting for the plan")
    chief.signal(signal.SIGKILL)
    assert worker.wait(30) != 0
    assert cluster.address in worker.output() and "unreachable" in worker.output()
    assert "training started" not in worker.output()


def test_the_python_api_example_joins_and_gets_the_variables(cluster):
    from tests.procs import Proc

    chief = cluster.chief("--workers", "1", *FAST)
    example = Proc(["examples/train.py", "--chief", cluster.address], cluster.tmp / "example.log")
    cluster.procs.append(example)
    assert example.wait(60) == 0, example.output()
    assert chief.wait(30) == 0
    assert "trainable variables: 6" in example.output()
    assert "dense_1/kernel/replica_1" in example.output()
    assert "one step on dense_1/kernel: every replica updated" in example.output()


def test_the_python_api_example_works_on_a_model_without_dense_layers(cluster, tmp_path):
    from tests.procs import Proc

    spec = tmp_path / "other.yaml"
    spec.write_text(
        "variables:\n"
        "  - {name: step, shape: [], dtype: int64, initializer: zeros}\n"
        "  - {name: encoder/w, shape: [3, 4], dtype: float32, initializer: zeros}\n"
    )
    chief = cluster.chief("--workers", "1", "--model", str(spec), *FAST)
    example = Proc(["examples/train.py", "--chief", cluster.address], cluster.tmp / "example.log")
    cluster.procs.append(example)
    assert example.wait(60) == 0, example.output()
    assert chief.wait(30) == 0
    assert "one step on encoder/w: every replica updated" in example.output()


def test_a_worker_declaring_a_different_model_is_refused_before_any_bytes_move(tmp_path, cluster):
    chief_spec = tmp_path / "chief.yaml"
    chief_spec.write_text(
        "variables:\n"
        "  - {name: w, shape: [3, 4], dtype: float32, initializer: zeros}\n"
        "  - {name: b, shape: [4], dtype: float32, initializer: zeros}\n"
    )
    worker_spec = tmp_path / "worker.yaml"
    worker_spec.write_text(
        "variables:\n"
        "  - {name: w, shape: [4, 3], dtype: float32, initializer: zeros}\n"
        "  - {name: extra, shape: [2], dtype: int64, initializer: zeros}\n"
    )
    chief = cluster.chief("--workers", "1", "--model", str(chief_spec), *FAST)
    odd = cluster.worker("odd", "--expect-model", str(worker_spec), *FAST)
    assert odd.wait(30) != 0
    out = odd.output()
    assert "w: chief (3, 4) float32 vs worker (4, 3) float32" in out
    assert "b: chief (4,) float32 vs worker (missing)" in out
    assert "extra: chief (missing) vs worker (2,) int64" in out
    assert "phase=receive" not in out  # refused at join: no plan, no bytes
    same = cluster.worker("same", "--expect-model", str(chief_spec), *FAST)
    assert same.wait(30) == 0, same.output()
    assert chief.wait(30) == 0


def test_every_collective_rpc_refuses_a_wrong_token_before_any_state_changes(cluster):
    import grpc

    from collective._proto import collective_pb2 as pb
    from collective._proto import collective_pb2_grpc as pb_grpc

    cluster.chief("--workers", "1", *FAST, env={"COLLECTIVE_TOKEN": "right"})
    ref = pb.WorkerRef(worker_id="x", incarnation="i")
    calls = {
        "Join": pb.JoinRequest(worker_id="x", incarnation="i", devices=["cpu:0"]),
        "GetPlan": ref, "AwaitPrepared": ref, "Fetch": ref, "AwaitStart": ref, "Heartbeat": ref, "Presence": ref,
        "ReportReady": iter([pb.Piece(data=pb.ReadyRequest(worker=ref).SerializeToString())]),
        "ReportFailure": pb.FailureReport(worker=ref, message="boom"),
        "Status": pb.StatusRequest(),
    }
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.CollectiveStub(channel)
        for name, request in calls.items():
            method = getattr(stub, name)
            with pytest.raises(grpc.RpcError) as info:
                result = method(request, timeout=5, metadata=(("x-collective-token", "wrong"),))
                if name in ("Fetch", "GetPlan"):
                    list(result)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        from collective.transport.grpc import RAW_FETCH

        raw = channel.unary_stream(RAW_FETCH, request_serializer=pb.WorkerRef.SerializeToString,
                                   response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            list(raw(ref, timeout=5, metadata=(("x-collective-token", "wrong"),)))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, "FetchRaw"
        status = stub.Status(pb.StatusRequest(), timeout=5, metadata=(("x-collective-token", "right"),))
    # Nothing changed: no one joined. (The chief binds before it loads its model, so on a busy
    # machine it may still be loading.)
    assert status.joined == 0 and status.phase in ("loading", "joining"), status
