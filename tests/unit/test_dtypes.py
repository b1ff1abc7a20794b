"""bfloat16 and float8 variables (ml_dtypes): sources, specs, plans, digests keep every bit."""

from __future__ import annotations

import zipfile

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from collective import dtypes
from collective._proto import collective_pb2 as pb
from collective.chief.arena import materialize
from collective.digest import array_digest, bytes_digest
from collective.errors import ModelError, ProtocolError
from collective.plan import build_plan, declaration_differences, declared, validate_plan
from collective.sources import load_source, save_npz
from collective.variables import VariableStore, create_variable
from tests.clusters import ArraySource
from tests.framework.conftest import require

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
# Quiet and signalling NaNs with payloads, -0.0, +-inf, the smallest subnormal, 1.0.
BF16_BITS = np.array([0x7FC3, 0xFFC1, 0x7F81, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x3F80], "<u2")


def bf16_payloads() -> np.ndarray:
    return BF16_BITS.view(BF16).reshape(2, 4)


def values(source) -> dict[str, np.ndarray]:
    out = {}
    for spec in source.specs():
        out[spec.name] = np.empty(spec.shape, spec.np_dtype)
        source.fill(spec, out[spec.name])
    return out


def test_wire_names_round_trip_and_plain_dtypes_keep_numpy_strings():
    for name in dtypes.EXTENDED:
        dt = dtypes.from_wire(name)
        assert dtypes.is_extended(dt) and dtypes.wire(dt) == name
    assert dtypes.wire(np.dtype(">f4")) == ">f4"
    assert not dtypes.is_extended(np.dtype("V2"))  # raw void is not bfloat16
    assert dtypes.is_float(E5M2) and dtypes.is_float(np.dtype("f2")) and not dtypes.is_float(np.dtype("i4"))


def test_safetensors_bf16_and_float8_from_the_safetensors_package_keep_bits(tmp_path):
    path = tmp_path / "w.safetensors"
    arrays = {
        "model.norm.weight": bf16_payloads(),
        "fp8.e4m3": np.array([0x7F, 0xFF, 0x80, 0x01], "u1").view(E4M3),
        "fp8.e5m2": np.array([0x7F, 0xFE, 0x80, 0x7C], "u1").view(E5M2),
        "f32": np.arange(3, dtype=np.float32),
    }
    save_file(arrays, str(path))
    source = load_source(str(path))
    assert {s.name: s.dtype for s in source.specs()} == {
        "model.norm.weight": "bfloat16", "fp8.e4m3": "float8_e4m3fn", "fp8.e5m2": "float8_e5m2", "f32": "<f4",
    }
    got = values(source)
    for name, a in arrays.items():
        assert got[name].dtype == a.dtype and got[name].tobytes() == a.tobytes()
        assert array_digest(got[name]) == bytes_digest(a.tobytes())  # digests keep their meaning


def test_torch_bf16_state_dict_saved_by_safetensors_torch_keeps_bits(tmp_path):
    torch = require("torch")
    from safetensors.torch import save_file as save_torch

    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 3).to(torch.bfloat16)
    with torch.no_grad():  # a NaN with a payload survives too
        layer.bias.view(torch.int16)[0] = 0x7FC5
    path = tmp_path / "torch.safetensors"
    save_torch(layer.state_dict(), str(path))
    got = values(load_source(str(path)))
    for name, t in layer.state_dict().items():
        assert got[name].dtype == BF16
        assert got[name].view(np.uint16).tolist() == t.view(torch.int16).numpy().view(np.uint16).tolist()


def test_npz_stores_raw_void_and_names_the_types(tmp_path):
    path = tmp_path / "m.npz"
    arrays = {"w": bf16_payloads(), "f8": np.array([0x7F, 0x80], "u1").view(E5M2), "x": np.arange(2.0)}
    save_npz(path, arrays)
    with zipfile.ZipFile(path) as z:  # any numpy reads it: raw void bytes plus a unicode scalar
        assert sorted(z.namelist()) == ["__dtypes__.npy", "f8.npy", "w.npy", "x.npy"]
    plain = np.load(path)
    assert plain["w"].dtype == np.dtype("V2") and plain["w"].tobytes() == arrays["w"].tobytes()
    source = load_source(str(path))
    assert [(s.name, s.dtype) for s in source.specs()] == [("w", "bfloat16"), ("f8", "float8_e5m2"), ("x", "<f8")]
    got = values(source)
    assert all(got[n].dtype == a.dtype and got[n].tobytes() == a.tobytes() for n, a in arrays.items())


def test_npz_raw_void_without_types_is_refused_with_a_hint(tmp_path):
    path = tmp_path / "raw.npz"
    np.savez(path, w=bf16_payloads())  # what numpy alone writes: '<V2'
    with pytest.raises(ModelError, match=r"raw.npz: array 'w': raw void dtype '\|V2' has no type.*save_npz"):
        load_source(str(path))


def test_npz_types_member_must_match(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, w=np.zeros(2, "V4"), __dtypes__=np.array('{"w": "bfloat16"}'))
    with pytest.raises(ModelError, match=r"array 'w': __dtypes__ says bfloat16 but the array is stored as '\|V4'"):
        load_source(str(path))
    np.savez(path, w=np.zeros(2, "V2"), __dtypes__=np.array('{"w": "bfloat32"}'))
    with pytest.raises(ModelError, match=r"__dtypes__.npy': array 'w': unknown type 'bfloat32'"):
        load_source(str(path))


def test_spec_bfloat16_generates_values_and_is_deterministic(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(
        "seed: 3\nvariables:\n"
        "  - {name: k, shape: [4, 8], dtype: bfloat16, initializer: glorot_uniform}\n"
        "  - {name: b, shape: [8], dtype: float8_e4m3fn, initializer: {type: constant, value: 0.5}}\n"
        "  - {name: n, shape: [64], dtype: bfloat16, initializer: truncated_normal}\n"
    )
    a, b = values(load_source(str(path))), values(load_source(str(path)))
    assert a["k"].dtype == BF16 and a["k"].tobytes() == b["k"].tobytes() and np.abs(a["k"].astype(np.float32)).max() > 0
    assert a["b"].astype(np.float32).tolist() == [0.5] * 8
    assert np.abs(a["n"].astype(np.float32)).max() <= 2 * 0.05 * 1.01


def test_spec_bfloat16_constant_out_of_range_is_refused(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("variables:\n  - {name: b, shape: [1], dtype: float8_e4m3fn, initializer: {type: constant, value: 1000}}\n")
    with pytest.raises(ModelError, match="value 1000 does not fit dtype float8_e4m3fn"):
        load_source(str(path))


def test_plan_and_declarations_accept_extended_names_only_in_canonical_form():
    arrays = {"w": bf16_payloads(), "f": np.zeros(3, E4M3)}
    specs, arena, digests = materialize(ArraySource(arrays))
    workers = [pb.WorkerInfo(rank=0, worker_id="w0", devices=["cpu:0"])]
    plan = build_plan(specs, digests, workers, arena=arena, chunk_bytes=64, chief_incarnation="x", model="m")
    validate_plan(plan)
    assert [v.dtype for v in plan.variables] == ["bfloat16", "float8_e4m3fn"]
    assert plan.variables[0].digest == bytes_digest(BF16_BITS.tobytes())
    for bad in ("<V2", "BFLOAT16", "float4_e2m1fn"):
        broken = pb.Plan.FromString(plan.SerializeToString())
        broken.variables[0].dtype = bad
        with pytest.raises(ProtocolError, match="dtype"):
            validate_plan(broken)
    mine = declared(specs)
    mine[0].dtype = "<f2"  # same size, other type: a difference, listed
    assert declaration_differences(specs, mine) == ["w: chief (2, 4) bfloat16 vs worker (2, 4) float16"]


def test_mirrored_bfloat16_variable_with_nan_payload():
    store = VariableStore()
    v = create_variable("w", bf16_payloads(), devices=["cpu:0", "cpu:1"], store=store)
    assert v.spec.dtype == "bfloat16"
    assert all(r.tobytes() == bf16_payloads().tobytes() for r in v.replicas)
