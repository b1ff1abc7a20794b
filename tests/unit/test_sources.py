"""Tests of collective.sources: presets, YAML/JSON specs, .npz and .safetensors files."""

from __future__ import annotations

import copy
import io
import json
import math
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import xxhash
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from safetensors.numpy import save_file

from collective._proto import collective_pb2 as pb
from collective.errors import ModelError
from collective.model import (
    Aggregation,
    Synchronization,
    VariableSpec,
    available_memory,
    check_fits,
    quoted,
)
from collective.sources import (
    PRESETS,
    RANDOM_BLOCK_ELEMENTS,
    NpzSource,
    SafetensorsSource,
    SpecSource,
    keras_fans,
    load_source,
    preset_document,
    preset_names,
    variable_rng,
)

# ----------------------------------------------------------------------------- helpers


def var(name: str, shape, dtype: str = "float32", initializer: object = "zeros", **extra) -> dict:
    return {"name": name, "shape": list(shape), "dtype": dtype, "initializer": initializer, **extra}


def write_yaml(path: Path, document: object) -> Path:
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def write_json(path: Path, document: object) -> Path:
    path.write_text(json.dumps(document))
    return path


def spec_file(tmp_path: Path, variables: list, seed: int | None = 0, name: str = "model.yaml") -> Path:
    document: dict = {"variables": variables}
    if seed is not None:
        document["seed"] = seed
    writer = write_json if name.endswith(".json") else write_yaml
    return writer(tmp_path / name, document)


def values(source) -> dict[str, np.ndarray]:
    result = {}
    for spec in source.specs():
        out = np.empty(spec.shape, spec.np_dtype)
        source.fill(spec, out)
        result[spec.name] = out
    return result


def single(tmp_path: Path, initializer: object, shape=(2000,), dtype="float32", seed=0) -> np.ndarray:
    path = spec_file(tmp_path, [var("v", shape, dtype, initializer)], seed=seed)
    return values(load_source(str(path)))["v"]


def as_bytes(arrays: dict[str, np.ndarray]) -> dict[str, bytes]:
    return {name: a.tobytes() for name, a in arrays.items()}


def raises_model_error(ref, *fragments: str, seed: int | None = None) -> ModelError:
    with pytest.raises(ModelError) as info:
        load_source(str(ref), seed=seed)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return info.value


def write_safetensors(path: Path, header: dict, data: bytes = b"", header_len: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    length = len(raw) if header_len is None else header_len
    path.write_bytes(length.to_bytes(8, "little") + raw + data)
    return path


# ----------------------------------------------------------------------------- initializers


def test_zeros_and_ones_are_exact_for_every_kind(tmp_path):
    dtypes = ["bool", "int8", "uint16", "int64", "float16", "float32", ">f8", "complex64"]
    variables = [var(f"z_{d}", (3, 4), d, "zeros") for d in dtypes]
    variables += [var(f"o_{d}", (3, 4), d, "ones") for d in dtypes]
    got = values(load_source(str(spec_file(tmp_path, variables))))
    for d in dtypes:
        assert got[f"z_{d}"].dtype == np.dtype(d)
        assert got[f"z_{d}"].tobytes() == np.zeros((3, 4), d).tobytes()
        assert got[f"o_{d}"].tobytes() == np.ones((3, 4), d).tobytes()


def test_constant_is_exact(tmp_path):
    variables = [
        var("f32", (5,), "float32", {"type": "constant", "value": 0.1}),
        var("f16", (2, 2), "float16", {"type": "constant", "value": -2.5}),
        var("i64", (3,), "int64", {"type": "constant", "value": 2**62 + 1}),
        var("u8", (), "uint8", {"type": "constant", "value": 255}),
        var("b", (2,), "bool", {"type": "constant", "value": True}),
        var("i_from_float", (2,), "int32", {"type": "constant", "value": 7.0}),
    ]
    got = values(load_source(str(spec_file(tmp_path, variables))))
    assert got["f32"].tobytes() == np.full(5, 0.1, np.float32).tobytes()
    assert got["f16"].tobytes() == np.full((2, 2), -2.5, np.float16).tobytes()
    assert got["i64"].tolist() == [2**62 + 1] * 3
    assert got["u8"].shape == () and int(got["u8"]) == 255
    assert got["b"].tolist() == [True, True]
    assert got["i_from_float"].tolist() == [7, 7]


def test_uniform_within_bounds(tmp_path):
    out = single(tmp_path, {"type": "uniform", "minval": -0.3, "maxval": 0.7}, shape=(100_000,))
    assert out.min() >= np.float32(-0.3) and out.max() <= np.float32(0.7)
    assert abs(out.mean() - 0.2) < 0.01
    assert abs(out.std() - 1.0 / math.sqrt(12)) < 0.01


def test_uniform_defaults(tmp_path):
    out = single(tmp_path, "uniform", shape=(50_000,))
    assert out.min() >= np.float32(-0.05) and out.max() <= np.float32(0.05)
    assert out.min() < -0.049 and out.max() > 0.049


def test_normal_statistics(tmp_path):
    out = single(tmp_path, {"type": "normal", "mean": 1.5, "stddev": 0.5}, shape=(200_000,))
    assert abs(out.mean() - 1.5) < 0.01
    assert abs(out.std() - 0.5) < 0.01
    assert np.abs(out - 1.5).max() > 1.0  # not truncated


def test_normal_default_parameters(tmp_path):
    out = single(tmp_path, "normal", shape=(200_000,))
    assert abs(out.mean()) < 0.001
    assert abs(out.std() - 0.05) < 0.001


def test_truncated_normal_within_two_stddev(tmp_path):
    out = single(tmp_path, {"type": "truncated_normal", "mean": -1.0, "stddev": 0.25}, shape=(200_000,))
    deviation = np.abs(out.astype(np.float64) + 1.0)
    assert deviation.max() <= 0.5 * (1 + 1e-6)
    assert deviation.max() > 0.49
    # A unit normal truncated to [-2, 2] has standard deviation 0.8796...
    assert abs(out.std() - 0.25 * 0.87962566103423978) < 0.002
    assert abs(out.mean() + 1.0) < 0.002


def test_truncated_normal_across_blocks(tmp_path):
    n = RANDOM_BLOCK_ELEMENTS + 12345
    out = single(tmp_path, {"type": "truncated_normal", "stddev": 1.0}, shape=(n,), dtype="float64")
    assert np.abs(out).max() <= 2.0
    assert abs(out.std() - 0.87962566103423978) < 0.005


@pytest.mark.parametrize(
    ("shape", "fans"),
    [((), (1, 1)), ((7,), (7, 7)), ((300, 200), (300, 200)), ((3, 3, 16, 32), (144, 288))],
)
def test_keras_fans(shape, fans):
    assert keras_fans(shape) == fans


@pytest.mark.parametrize("shape", [(300, 200), (3, 3, 16, 32), (5000,)])
def test_glorot_uniform_limit(tmp_path, shape):
    fan_in, fan_out = keras_fans(shape)
    limit = math.sqrt(6 / (fan_in + fan_out))
    out = single(tmp_path, "glorot_uniform", shape=shape)
    assert np.abs(out).max() <= np.float32(limit)
    assert np.abs(out).max() > 0.98 * limit
    assert abs(out.std() - limit / math.sqrt(3)) < 0.03 * limit


def test_he_normal_is_truncated_with_keras_stddev(tmp_path):
    shape = (512, 256)
    out = single(tmp_path, "he_normal", shape=shape).astype(np.float64)
    stddev = math.sqrt(2 / 512) / 0.87962566103423978
    assert np.abs(out).max() <= 2 * stddev * (1 + 1e-6)
    # Keras' correction makes the truncated distribution's stddev sqrt(2 / fan_in).
    assert abs(out.std() - math.sqrt(2 / 512)) < 0.01 * math.sqrt(2 / 512)


def test_values_follow_the_documented_generator(tmp_path):
    path = spec_file(tmp_path, [var("dense/kernel", (10, 30), "float32", {"type": "normal", "stddev": 1.0})], seed=42)
    got = values(load_source(str(path)))["dense/kernel"]
    key = xxhash.xxh64_intdigest(b"dense/kernel")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([42, key])))
    assert got.tobytes() == rng.standard_normal((10, 30), dtype=np.float32).tobytes()
    again = variable_rng(42, "dense/kernel").standard_normal((10, 30), dtype=np.float32)
    assert got.tobytes() == again.tobytes()


def test_large_uniform_is_blockwise_identical_to_one_draw(tmp_path):
    n = 2 * RANDOM_BLOCK_ELEMENTS + 7
    got = single(tmp_path, {"type": "uniform", "minval": 0.0, "maxval": 1.0}, shape=(n,), seed=5)
    expected = variable_rng(5, "v").random(n, dtype=np.float32)
    assert got.tobytes() == expected.tobytes()


def test_float16_and_big_endian_share_the_float32_stream(tmp_path):
    init = {"type": "truncated_normal", "stddev": 0.5}
    base = single(tmp_path, init, shape=(64, 64), dtype="float32")
    half = single(tmp_path, init, shape=(64, 64), dtype="float16")
    swapped = single(tmp_path, init, shape=(64, 64), dtype=">f4")
    assert half.dtype == np.float16 and swapped.dtype == np.dtype(">f4")
    assert half.tobytes() == base.astype(np.float16).tobytes()
    assert swapped.tobytes() == base.astype(">f4").tobytes()


def test_random_values_do_not_depend_on_other_variables_or_order(tmp_path):
    a = var("a", (100,), "float32", "glorot_uniform")
    b = var("b", (50, 2), "float64", {"type": "normal"})
    first = values(load_source(str(spec_file(tmp_path, [a, b], name="one.yaml"))))
    second = values(load_source(str(spec_file(tmp_path, [b, var("c", (3,)), a], name="two.yaml"))))
    assert first["a"].tobytes() == second["a"].tobytes()
    assert first["b"].tobytes() == second["b"].tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_random_fill_does_not_copy_the_variable(tmp_path, dtype):
    n = 8 * RANDOM_BLOCK_ELEMENTS
    path = spec_file(
        tmp_path,
        [var("t", (n,), dtype, {"type": "truncated_normal"}), var("u", (n,), dtype, "uniform")],
    )
    source = load_source(str(path))
    for spec in source.specs():
        out = np.empty(spec.shape, spec.np_dtype)
        tracemalloc.start()
        try:
            source.fill(spec, out)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < out.nbytes / 3, (spec.name, peak, out.nbytes)


def test_fill_into_unaligned_arena_views(tmp_path):
    # The chief fills views of one uint8 arena; they need not be aligned.
    source = load_source(str(spec_file(tmp_path, MODEL_FOR_ARENA)))
    expected = values(source)
    for spec in source.specs():
        arena = np.zeros(spec.nbytes + 1, np.uint8)
        view = arena[1:].view(spec.np_dtype).reshape(spec.shape)
        assert not view.flags.aligned or spec.np_dtype.itemsize == 1
        source.fill(spec, view)
        assert view.tobytes() == expected[spec.name].tobytes(), spec.name


MODEL_FOR_ARENA = [
    var("n32", (1000,), "float32", {"type": "normal"}),
    var("t64", (10, 10), "float64", "truncated_normal"),
    var("u16", (7,), "float16", "uniform"),
    var("g", (3, 3, 4, 8), "float32", "glorot_uniform"),
    var("c", (5,), "int32", {"type": "constant", "value": -3}),
]


# ----------------------------------------------------------------------------- seeds


MODEL = [
    var("dense/kernel", (64, 32), "float32", "glorot_uniform"),
    var("dense/bias", (32,), "float32", "zeros"),
    var("emb", (100, 8), "float64", {"type": "truncated_normal", "stddev": 0.02}),
    var("half", (16,), "float16", "he_normal"),
]


def test_same_seed_gives_identical_bytes(tmp_path):
    path = spec_file(tmp_path, MODEL, seed=7)
    assert as_bytes(values(load_source(str(path)))) == as_bytes(values(load_source(str(path))))


def test_different_seed_gives_different_bytes(tmp_path):
    one = values(load_source(str(spec_file(tmp_path, MODEL, seed=1, name="a.yaml"))))
    two = values(load_source(str(spec_file(tmp_path, MODEL, seed=2, name="b.yaml"))))
    for name in ("dense/kernel", "emb", "half"):
        assert one[name].tobytes() != two[name].tobytes()
    assert one["dense/bias"].tobytes() == two["dense/bias"].tobytes()


def test_seed_override(tmp_path):
    seven = spec_file(tmp_path, MODEL, seed=7, name="seven.yaml")
    three = spec_file(tmp_path, MODEL, seed=3, name="three.yaml")
    overridden = load_source(str(seven), seed=3)
    assert overridden.seed == 3
    assert load_source(str(seven)).seed == 7
    assert as_bytes(values(overridden)) == as_bytes(values(load_source(str(three))))


def test_seed_defaults_to_zero(tmp_path):
    no_seed = spec_file(tmp_path, MODEL, seed=None, name="noseed.yaml")
    zero = spec_file(tmp_path, MODEL, seed=0, name="zero.yaml")
    assert as_bytes(values(load_source(str(no_seed)))) == as_bytes(values(load_source(str(zero))))


@pytest.mark.parametrize("seed", [-1, 1.5, True, "3"])
def test_invalid_seed_override(tmp_path, seed):
    path = spec_file(tmp_path, MODEL)
    with pytest.raises(ModelError, match="seed must be a non-negative integer"):
        load_source(str(path), seed=seed)


def test_big_seed_is_fine(tmp_path):
    path = spec_file(tmp_path, MODEL, seed=2**100)
    assert load_source(str(path)).seed == 2**100


# ----------------------------------------------------------------------------- spec format


def test_yaml_and_json_are_equivalent(tmp_path):
    variables = MODEL + [
        var("step", (), "int64", "zeros", trainable=False, aggregation="only_first_replica"),
        var("acc", (4,), "float32", "zeros", synchronization="on_read", aggregation="SUM"),
    ]
    from_yaml = load_source(str(spec_file(tmp_path, variables, seed=11, name="m.yml")))
    from_json = load_source(str(spec_file(tmp_path, variables, seed=11, name="m.json")))
    assert from_yaml.specs() == from_json.specs()
    assert as_bytes(values(from_yaml)) == as_bytes(values(from_json))


def test_spec_fields(tmp_path):
    text = """
seed: 3
variables:
  - name: dense/kernel
    shape: [4, 2]
    dtype: float32
    initializer: {type: normal, stddev: 0.1}
  - name: counter
    shape: []
    dtype: int64
    initializer: zeros
    synchronization: on_read
    aggregation: sum
    trainable: false
  - name: flags
    shape: [3]
    dtype: bool
    initializer: ones
"""
    path = tmp_path / "model.yaml"
    path.write_text(text)
    source = load_source(str(path))
    assert source.description == str(path)
    assert source.specs() == [
        VariableSpec("dense/kernel", (4, 2), "<f4"),
        VariableSpec("counter", (), "<i8", Synchronization.ON_READ, Aggregation.SUM, False),
        VariableSpec("flags", (3,), "|b1"),
    ]


def test_spec_source_from_a_mapping():
    source = SpecSource({"variables": [var("x", (2,), "float32", "ones")]}, label="inline")
    assert [s.name for s in source.specs()] == ["x"]
    out = np.empty(2, np.float32)
    source.fill(source.specs()[0], out)
    assert out.tolist() == [1.0, 1.0]


def test_empty_variable_is_fine(tmp_path):
    path = spec_file(tmp_path, [var("e", (0, 3), "float32", "glorot_uniform")])
    assert values(load_source(str(path)))["e"].shape == (0, 3)


def test_fill_checks_the_buffer(tmp_path):
    source = load_source(str(spec_file(tmp_path, [var("x", (4, 4), "float32", "uniform")])))
    spec = source.specs()[0]
    with pytest.raises(ValueError, match="expected"):
        source.fill(spec, np.empty((4, 5), np.float32))
    with pytest.raises(ValueError, match="expected"):
        source.fill(spec, np.empty((4, 4), np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        source.fill(spec, np.empty((4, 4), np.float32, order="F"))
    with pytest.raises(ValueError, match="no variable"):
        source.fill(VariableSpec("y", (1,), "<f4"), np.empty(1, np.float32))


# ----------------------------------------------------------------------------- bad specs

GOOD = var("dense/kernel", (4, 2), "float32", "glorot_uniform")

BAD_ENTRIES = [
    ({"dtype": "flaot32"}, "variable 'dense/kernel': unknown dtype 'flaot32'"),
    ({"dtype": "bfloat17"}, "variable 'dense/kernel': unknown dtype 'bfloat17'"),
    ({"dtype": "float4_e2m1fn"}, "variable 'dense/kernel': unsupported dtype 'float4_e2m1fn'; use bool"),
    ({"dtype": "object"}, "variable 'dense/kernel': unsupported dtype 'object'"),
    ({"dtype": "U5"}, "variable 'dense/kernel': unsupported dtype"),
    ({"dtype": "S3"}, "variable 'dense/kernel': unsupported dtype"),
    ({"dtype": "V8"}, "variable 'dense/kernel': unsupported dtype"),
    ({"dtype": "f4,i4"}, "variable 'dense/kernel': unsupported dtype '|V8' (structured"),
    ({"dtype": "datetime64[s]"}, "variable 'dense/kernel': unsupported dtype"),
    ({"dtype": "float128"}, "variable 'dense/kernel': unsupported dtype"),
    ({"dtype": 32}, "variable 'dense/kernel': dtype must be"),
    ({"dtype": "a"}, "variable 'dense/kernel': unknown dtype 'a'"),
    ({"shape": [4, -2]}, "variable 'dense/kernel': shape [4, -2]: dimension -2"),
    ({"shape": [4, 1.5]}, "variable 'dense/kernel': shape [4, 1.5]: dimension 1.5"),
    ({"shape": ["4"]}, "variable 'dense/kernel': shape ['4']: dimension '4'"),
    ({"shape": [True]}, "variable 'dense/kernel': shape [True]: dimension True"),
    ({"shape": 4}, "variable 'dense/kernel': shape must be a list"),
    ({"initializer": "glorot"}, "variable 'dense/kernel': unknown initializer 'glorot'"),
    ({"initializer": {"type": "nope"}}, "variable 'dense/kernel': unknown initializer 'nope'"),
    ({"initializer": {"stddev": 1}}, "variable 'dense/kernel': initializer mapping needs a 'type'"),
    ({"initializer": 3}, "variable 'dense/kernel': initializer must be"),
    (
        {"initializer": {"type": "normal", "stdev": 1}},
        "variable 'dense/kernel': initializer 'normal': unknown parameter 'stdev'",
    ),
    (
        {"initializer": {"type": "zeros", "value": 1}},
        "variable 'dense/kernel': initializer 'zeros': unknown parameter 'value'",
    ),
    (
        {"initializer": {"type": "normal", "stddev": "big"}},
        "variable 'dense/kernel': initializer 'normal': parameter 'stddev' must be a finite number",
    ),
    (
        {"initializer": {"type": "normal", "stddev": float("nan")}},
        "variable 'dense/kernel': initializer 'normal': parameter 'stddev' must be a finite number",
    ),
    ({"initializer": {"type": "normal", "stddev": -1}}, "variable 'dense/kernel': initializer 'normal': stddev -1.0 is negative"),
    (
        {"initializer": {"type": "uniform", "minval": 1, "maxval": 0}},
        "variable 'dense/kernel': initializer 'uniform': minval 1.0 is greater than maxval 0.0",
    ),
    (
        {"dtype": "float16", "initializer": {"type": "uniform", "maxval": 1e6}},
        "variable 'dense/kernel': initializer 'uniform': maxval 1000000.0 is out of range for float16",
    ),
    ({"initializer": "constant"}, "variable 'dense/kernel': initializer 'constant' needs a 'value'"),
    (
        {"dtype": "int8", "initializer": {"type": "constant", "value": 300}},
        "variable 'dense/kernel': initializer 'constant': value 300 does not fit dtype int8",
    ),
    (
        {"dtype": "int8", "initializer": {"type": "constant", "value": 1.5}},
        "variable 'dense/kernel': initializer 'constant': value 1.5 does not fit dtype int8",
    ),
    (
        {"dtype": "bool", "initializer": {"type": "constant", "value": 2}},
        "variable 'dense/kernel': initializer 'constant': value 2 does not fit dtype bool",
    ),
    (
        {"initializer": {"type": "constant", "value": "x"}},
        "variable 'dense/kernel': initializer 'constant': value 'x' does not fit dtype float32",
    ),
    ({"dtype": "int32", "initializer": "glorot_uniform"}, "variable 'dense/kernel': initializer 'glorot_uniform' needs a float dtype"),
    ({"dtype": "complex64", "initializer": "normal"}, "variable 'dense/kernel': initializer 'normal' needs a float dtype, not complex64"),
    ({"dtype": "bool", "initializer": "uniform"}, "variable 'dense/kernel': initializer 'uniform' needs a float dtype"),
    ({"synchronization": "sometimes"}, "variable 'dense/kernel': unknown synchronization 'sometimes'; use one of AUTO"),
    ({"aggregation": "average"}, "variable 'dense/kernel': unknown aggregation 'average'; use one of NONE"),
    ({"aggregation": 2}, "variable 'dense/kernel': unknown aggregation 2"),
    ({"trainable": "yes please"}, "variable 'dense/kernel': trainable must be true or false"),
    ({"dtpye": "float32"}, "variable 'dense/kernel': unknown key 'dtpye'"),
    ({"name": ""}, "variable #2: empty variable name"),
    ({"name": 5}, "variable #2: name must be a non-empty string"),
]


@pytest.mark.parametrize(("change", "expected"), BAD_ENTRIES)
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_bad_entry(tmp_path, change, expected, suffix):
    entry = {**GOOD, **change}
    path = spec_file(tmp_path, [var("ok", (1,)), entry], name="model" + suffix)
    raises_model_error(path, f"model{suffix}: {expected}")


@pytest.mark.parametrize("missing", ["name", "shape", "dtype", "initializer"])
def test_missing_required_key(tmp_path, missing):
    entry = copy.deepcopy(GOOD)
    del entry[missing]
    where = "variable #1" if missing == "name" else "variable 'dense/kernel'"
    raises_model_error(spec_file(tmp_path, [entry]), f"model.yaml: {where}: missing '{missing}'")


def test_duplicate_names(tmp_path):
    path = spec_file(tmp_path, [var("a", (1,)), var("b", (1,)), var("a", (2,))])
    raises_model_error(path, "model.yaml: variable 'a': duplicate name (entry #3)")


def test_entry_must_be_a_mapping(tmp_path):
    raises_model_error(spec_file(tmp_path, [var("a", (1,)), "b"]), "model.yaml: variable #2: expected a mapping")


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ([1, 2], "model.yaml: expected a mapping with 'seed' and 'variables' at the top level, not list"),
        ({"seed": 1}, "model.yaml: missing 'variables'"),
        ({"variables": []}, "model.yaml: 'variables' is empty"),
        ({"variables": {"a": 1}}, "model.yaml: 'variables' must be a list"),
        ({"seed": -3, "variables": [GOOD]}, "model.yaml: seed must be a non-negative integer, not -3"),
        ({"seed": 1.5, "variables": [GOOD]}, "model.yaml: seed must be a non-negative integer"),
        ({"sead": 1, "variables": [GOOD]}, "model.yaml: unknown top-level key 'sead'"),
    ],
)
def test_bad_top_level(tmp_path, document, expected):
    raises_model_error(write_yaml(tmp_path / "model.yaml", document), expected)


def test_empty_yaml(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("# nothing\n")
    raises_model_error(path, "model.yaml: empty spec")


def test_bad_yaml_syntax(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("variables:\n  - name: [unclosed\n")
    raises_model_error(path, "model.yaml: invalid YAML at line")


def test_duplicate_yaml_key(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(
        "variables:\n  - name: a\n    shape: [1]\n    dtype: float32\n    dtype: int8\n"
        "    initializer: zeros\n"
    )
    raises_model_error(path, "model.yaml: invalid YAML at line 5", "duplicate key 'dtype'")


def test_yaml_merge_keys_still_work(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(
        "variables:\n  - &a {name: a, shape: [2], dtype: float32, initializer: ones}\n"
        "  - <<: *a\n    name: b\n"
    )
    source = load_source(str(path))
    assert [s.name for s in source.specs()] == ["a", "b"]


def test_bad_json_syntax(tmp_path):
    path = tmp_path / "model.json"
    path.write_text('{"variables": [}')
    raises_model_error(path, "model.json: invalid JSON at line 1, column 16")


def test_duplicate_json_key(tmp_path):
    path = tmp_path / "model.json"
    path.write_text('{"seed": 1, "seed": 2, "variables": []}')
    raises_model_error(path, "model.json: invalid JSON: duplicate key 'seed'")


def test_not_utf8(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_bytes(b"variables: \xff\xfe\n")
    raises_model_error(path, "model.yaml: not UTF-8 text")


# ----------------------------------------------------------------------------- load_source


def test_unknown_preset_or_missing_file(tmp_path):
    error = raises_model_error("foo")
    assert str(error) == (
        "model 'foo': no such file or preset; use a .yaml/.json spec, .npz, .safetensors "
        "or one of: mlp, transformer-100m"
    )
    assert error.exit_code == 2
    raises_model_error(tmp_path / "missing.yaml", "missing.yaml", "no such file or preset")
    raises_model_error(tmp_path / "missing.npz", "missing.npz", "no such file or preset")


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 8)
    raises_model_error(path, "weights.bin", "unsupported file type '.bin'")


def test_directory(tmp_path):
    raises_model_error(tmp_path, "is a directory")


def test_errors_chain_their_cause(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("variables: [\n")
    error = raises_model_error(path, "model.yaml")
    assert isinstance(error.__cause__, yaml.YAMLError)


def test_accepts_path_objects(tmp_path):
    path = spec_file(tmp_path, [GOOD])
    assert load_source(path).specs()[0].name == "dense/kernel"


# ----------------------------------------------------------------------------- .npz


def npz_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "dense/kernel": rng.standard_normal((5, 3)).astype(np.float32),
        "big_endian": (np.arange(6).reshape(2, 3) / 7).astype(">f8"),
        "big_endian_int": np.arange(4, dtype=">i4"),
        "int8": np.array([-128, -1, 0, 127], dtype=np.int8),
        "scalar": np.array(3.25, dtype=np.float64),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "flags": np.array([True, False, True]),
        "complex": np.array([1 + 2j, -3j], dtype=np.complex128),
        "half": np.array([0.5, -1.25], dtype=np.float16),
        "uint64": np.array([2**64 - 1, 0], dtype=np.uint64),
        "fortran": np.asfortranarray(np.arange(24, dtype=np.int16).reshape(2, 3, 4)),
        "name.with.dots": np.ones(2, np.float32),
    }


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_npz_round_trip_is_byte_identical(tmp_path, save):
    arrays = npz_arrays()
    path = tmp_path / "weights.npz"
    save(path, **arrays)
    source = load_source(str(path), seed=99)  # the seed does not matter for stored values
    assert isinstance(source, NpzSource)
    assert source.description == str(path)
    specs = source.specs()
    assert [s.name for s in specs] == list(arrays)
    for spec in specs:
        array = arrays[spec.name]
        assert spec.dtype == array.dtype.str
        assert spec.shape == array.shape
        assert spec.synchronization is Synchronization.AUTO
        assert spec.aggregation is Aggregation.NONE
        assert spec.trainable is None
    got = values(source)
    for name, array in arrays.items():
        assert got[name].dtype == array.dtype
        assert got[name].tobytes() == np.ascontiguousarray(array).tobytes(), name
    assert got["big_endian"].dtype.str == ">f8"
    assert got["scalar"].shape == ()


def test_npz_large_fortran_array(tmp_path):
    array = np.asfortranarray(np.arange(3 * 700_000, dtype=np.float64).reshape(3, 700_000))
    path = tmp_path / "f.npz"
    np.savez(path, a=array)
    assert values(load_source(str(path)))["a"].tobytes() == np.ascontiguousarray(array).tobytes()


def test_npz_fill_does_not_copy_the_array(tmp_path):
    array = np.arange(4_000_000, dtype=np.float32)
    path = tmp_path / "w.npz"
    np.savez(path, w=array)
    source = load_source(str(path))
    out = np.empty(array.shape, array.dtype)
    tracemalloc.start()
    try:
        source.fill(source.specs()[0], out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.array_equal(out, array)
    assert peak < out.nbytes / 2


def test_npz_truncated(tmp_path):
    path = tmp_path / "weights.npz"
    np.savez(path, a=np.arange(1000.0))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    raises_model_error(path, "weights.npz: not a valid .npz archive")


def test_npz_garbage(tmp_path):
    path = tmp_path / "weights.npz"
    path.write_bytes(b"this is not a zip file at all")
    raises_model_error(path, "weights.npz: not a valid .npz archive")


def test_npz_object_array(tmp_path):
    path = tmp_path / "weights.npz"
    np.savez(path, good=np.zeros(2), bad=np.array([1, "x"], dtype=object))
    raises_model_error(path, "weights.npz: array 'bad': unsupported dtype 'object'")


@pytest.mark.parametrize(
    "array",
    [
        np.array(["a", "bc"]),
        np.zeros(2, dtype=[("x", "<f4"), ("y", "<i4")]),
        np.array([1, 2], dtype="datetime64[s]"),
    ],
)
def test_npz_unsupported_dtypes(tmp_path, array):
    path = tmp_path / "weights.npz"
    np.savez(path, bad=array)
    raises_model_error(path, "weights.npz: array 'bad': unsupported dtype")


def test_npz_non_array_member(tmp_path):
    path = tmp_path / "weights.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes.txt", "hello")
    raises_model_error(path, "weights.npz: member 'notes.txt' is not a .npy array")


def test_npz_corrupt_header(tmp_path):
    path = tmp_path / "weights.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("a.npy", b"\x93NUMPY\x01\x00garbage")
    raises_model_error(path, "weights.npz: array 'a': corrupt .npy header")


def test_npz_empty_archive(tmp_path):
    path = tmp_path / "weights.npz"
    with zipfile.ZipFile(path, "w"):
        pass
    raises_model_error(path, "weights.npz: the archive holds no arrays")


def test_npz_duplicate_member(tmp_path):
    path = tmp_path / "weights.npz"
    data = io.BytesIO()
    np.lib.format.write_array(data, np.zeros(2))
    with pytest.warns(UserWarning, match="Duplicate name"), zipfile.ZipFile(path, "w") as archive:
        archive.writestr("a.npy", data.getvalue())
        archive.writestr("a.npy", data.getvalue())
    raises_model_error(path, "weights.npz: array 'a': duplicate name")


def test_npz_truncated_member_data_fails_in_fill(tmp_path):
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (100,)})
    path = tmp_path / "weights.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("short.npy", header.getvalue() + b"\0" * 80)
    source = load_source(str(path))
    spec = source.specs()[0]
    with pytest.raises(ModelError, match=r"weights\.npz: array 'short': cannot read \(data is truncated"):
        source.fill(spec, np.empty(spec.shape, spec.np_dtype))


def test_npz_corrupt_data_fails_in_fill(tmp_path):
    path = tmp_path / "weights.npz"
    np.savez(path, a=np.arange(1000, dtype=np.float64))
    data = bytearray(path.read_bytes())
    data[500] ^= 0xFF  # inside the stored array: the CRC no longer matches
    path.write_bytes(bytes(data))
    source = load_source(str(path))
    spec = source.specs()[0]
    with pytest.raises(ModelError, match=r"weights\.npz: array 'a': cannot read \(Bad CRC-32"):
        source.fill(spec, np.empty(spec.shape, spec.np_dtype))


# ----------------------------------------------------------------------------- .safetensors


def safetensors_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "model.layers.0.attn.q_proj.weight": rng.standard_normal((4, 4)).astype(np.float32),
        "model/embed.tokens": rng.standard_normal((3, 2)),
        "f16": np.array([1.5, -2.0], dtype=np.float16),
        "i8": np.array([-5, 7], dtype=np.int8),
        "i16": np.array([-300], dtype=np.int16),
        "i32": np.array([1, 2, 3], dtype=np.int32),
        "i64": np.array([-(2**62)], dtype=np.int64),
        "u8": np.array([255], dtype=np.uint8),
        "u16": np.array([65535], dtype=np.uint16),
        "u32": np.array([2**32 - 1], dtype=np.uint32),
        "u64": np.array([2**64 - 1], dtype=np.uint64),
        "bool": np.array([True, False]),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


def test_safetensors_round_trip_is_byte_identical(tmp_path):
    arrays = safetensors_arrays()
    path = tmp_path / "weights.safetensors"
    save_file(arrays, str(path), metadata={"format": "np"})
    source = load_source(str(path))
    assert isinstance(source, SafetensorsSource)
    assert source.description == str(path)
    specs = {s.name: s for s in source.specs()}
    assert set(specs) == set(arrays)  # __metadata__ ignored, names kept exactly
    for name, array in arrays.items():
        assert specs[name].dtype == array.dtype.str
        assert specs[name].shape == array.shape
    got = values(source)
    for name, array in arrays.items():
        assert got[name].tobytes() == array.tobytes(), name


def test_safetensors_big_endian_input_is_stored_little_endian(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"x": np.arange(3, dtype=">f4")}, str(path))
    got = values(load_source(str(path)))["x"]
    assert got.dtype.str == "<f4" and got.tolist() == [0.0, 1.0, 2.0]


def test_safetensors_unsupported_dtype_names_the_tensor(tmp_path):
    header = {
        "ok": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "model.norm.weight": {"dtype": "F4", "shape": [2], "data_offsets": [4, 8]},
    }
    path = write_safetensors(tmp_path / "weights.safetensors", header, b"\0" * 8)
    raises_model_error(path, "weights.safetensors: tensor 'model.norm.weight': dtype 'F4' is not supported")


@pytest.mark.parametrize(
    ("header", "data", "expected"),
    [
        ({"a": {"dtype": "F6_E3M2", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "tensor 'a': dtype 'F6_E3M2'"),
        ({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2, "tensor 'a': data_offsets [0, 2] span 2 bytes but shape [2] BF16 needs 4"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "tensor 'a': data_offsets [0, 4] span 4 bytes"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "tensor 'a': shape [-1]"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, "tensor 'a': invalid data_offsets"),
        ({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, "tensor 'a': invalid data_offsets None"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "tensor 'a': data_offsets end at 8"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
            },
            b"\0" * 8,
            "tensor 'b': data_offsets start at 4, expected 8",
        ),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 6, "tensors cover 4 data bytes but the file holds 6"),
        ({"a": [1, 2]}, b"", "tensor 'a': expected a mapping"),
        ({"": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "empty tensor name"),
        ({"__metadata__": {"x": "y"}}, b"", "the file holds no tensors"),
    ],
)
def test_safetensors_bad_header(tmp_path, header, data, expected):
    path = write_safetensors(tmp_path / "weights.safetensors", header, data)
    raises_model_error(path, "weights.safetensors: ", expected)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"garbage", "too short for a header"),
        (b"\xff" * 8 + b"{}", "header length 18446744073709551615 exceeds"),
        ((1000).to_bytes(8, "little") + b"{}", "header length 1000 exceeds the file size"),
        ((4).to_bytes(8, "little") + b"[12]", "corrupt safetensors header (header is not a JSON object)"),
        ((4).to_bytes(8, "little") + b"{abc", "corrupt safetensors header"),
        ((3).to_bytes(8, "little") + b"{\xff}", "corrupt safetensors header"),
        (b"this is definitely not a safetensors file", "header length"),
    ],
)
def test_safetensors_garbage(tmp_path, content, expected):
    path = tmp_path / "weights.safetensors"
    path.write_bytes(content)
    raises_model_error(path, "weights.safetensors: ", expected)


def test_safetensors_duplicate_tensor(tmp_path):
    raw = b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}'
    path = tmp_path / "weights.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0\0")
    raises_model_error(path, "weights.safetensors: corrupt safetensors header (duplicate key 'a')")


def test_safetensors_truncated(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"a": np.arange(100, dtype=np.float32)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    raises_model_error(path, "weights.safetensors: tensor 'a': data_offsets end at 400", "truncated")


def test_safetensors_truncated_after_load_fails_in_fill(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"a": np.arange(100, dtype=np.float32)}, str(path))
    source = load_source(str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    spec = source.specs()[0]
    with pytest.raises(ModelError, match=r"weights\.safetensors: tensor 'a': cannot read \(data is truncated"):
        source.fill(spec, np.empty(spec.shape, spec.np_dtype))


def test_safetensors_fill_does_not_copy_the_tensor(tmp_path):
    array = np.arange(4_000_000, dtype=np.float32)
    path = tmp_path / "w.safetensors"
    save_file({"w": array}, str(path))
    source = load_source(str(path))
    out = np.empty(array.shape, array.dtype)
    tracemalloc.start()
    try:
        source.fill(source.specs()[0], out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.array_equal(out, array)
    assert peak < out.nbytes / 4


_ROUND_TRIP_DTYPES = st.sampled_from(
    ["|b1", "|i1", "<i2", ">i4", "<i8", "|u1", ">u2", "<f2", "<f4", ">f8", "<c8", ">c16"]
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=_ROUND_TRIP_DTYPES,
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
    fortran=st.booleans(),
    data=st.data(),
)
def test_npz_round_trip_property(tmp_path, dtype, shape, fortran, data):
    array = data.draw(hnp.arrays(np.dtype(dtype), shape))
    if fortran:
        array = np.asfortranarray(array)
    path = tmp_path / "p.npz"
    np.savez(path, x=array)
    got = values(load_source(str(path)))["x"]
    assert got.dtype == array.dtype and got.shape == array.shape
    assert got.tobytes() == np.ascontiguousarray(array).tobytes()


# ----------------------------------------------------------------------------- presets


def test_preset_names():
    assert preset_names() == PRESETS == ("mlp", "transformer-100m")


def test_mlp_preset():
    source = load_source("mlp")
    assert source.description == "preset mlp (seed 0)"
    specs = {s.name: s for s in source.specs()}
    assert specs["dense_1/kernel"] == VariableSpec("dense_1/kernel", (784, 256), "<f4")
    assert specs["dense_3/bias"].shape == (10,)
    step = specs["global_step"]
    assert (step.shape, step.dtype, step.trainable) == ((), "<i8", False)
    got = values(source)
    assert not got["dense_1/bias"].any() and int(got["global_step"]) == 0
    limit = math.sqrt(6 / (784 + 256))
    assert np.abs(got["dense_1/kernel"]).max() <= np.float32(limit)
    assert as_bytes(got) == as_bytes(values(load_source("mlp")))


def test_mlp_preset_seed_override():
    seeded = load_source("mlp", seed=5)
    assert seeded.description == "preset mlp (seed 5)"
    spec = seeded.specs()[0]
    a = np.empty(spec.shape, spec.np_dtype)
    b = np.empty(spec.shape, spec.np_dtype)
    seeded.fill(spec, a)
    load_source("mlp").fill(spec, b)
    assert a.tobytes() != b.tobytes()


def test_preset_matches_its_yaml_spec(tmp_path):
    path = write_yaml(tmp_path / "mlp.yaml", preset_document("mlp"))
    from_file = load_source(str(path))
    preset = load_source("mlp")
    assert from_file.specs() == preset.specs()
    assert as_bytes(values(from_file)) == as_bytes(values(preset))


@pytest.mark.parametrize("ref", ["transformer-100m", "transformer", "Transformer"])
def test_transformer_preset_size(ref):
    source = load_source(ref)
    assert source.description == "preset transformer-100m (seed 0)"
    specs = source.specs()
    total = sum(s.size for s in specs)
    assert 95_000_000 <= total <= 110_000_000
    assert all(s.dtype == "<f4" for s in specs if s.name != "global_step")
    names = {s.name: s for s in specs}
    assert names["embeddings/token"].shape == (16384, 768)
    assert names["embeddings/position"].shape == (1024, 768)
    assert names["layer_11/attention/query/kernel"].shape == (768, 768)
    assert names["layer_00/mlp/dense_1/kernel"].shape == (768, 3072)
    assert names["layer_00/mlp/dense_2/kernel"].shape == (3072, 768)
    assert "layer_12/attention/query/kernel" not in names
    assert "final_norm/gamma" in names and "global_step" in names


def test_transformer_small_variables():
    source = load_source("transformer")
    specs = {s.name: s for s in source.specs()}
    gamma = np.empty(768, np.float32)
    source.fill(specs["final_norm/gamma"], gamma)
    assert (gamma == 1).all()
    bias = np.full(3072, 7, np.float32)
    source.fill(specs["layer_03/mlp/dense_1/bias"], bias)
    assert not bias.any()
    kernel = np.empty((768, 768), np.float32)
    source.fill(specs["layer_00/attention/key/kernel"], kernel)
    assert np.abs(kernel).max() <= np.float32(math.sqrt(6 / 1536)) and kernel.std() > 0.03


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"synchronization": "none"}, "synchronization NONE"),
        ({"synchronization": "on_read", "trainable": True}, "cannot be trainable"),
    ],
)
def test_spec_breaking_the_variable_rules_is_rejected_at_load_naming_the_entry(tmp_path, extra, words):
    import json

    entry = {"name": "v", "shape": [2], "dtype": "float32", "initializer": "zeros", **extra}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"variables": [entry]}))
    with pytest.raises(ModelError, match=words) as info:
        load_source(str(path))
    assert "bad.json" in str(info.value) and "'v'" in str(info.value)


# ----------------------------------------------------------------------------- memory bombs, overflow, names


def npz_with_header(path: Path, shape_text: str, name: str = "x") -> Path:
    """An .npz whose one member claims ``shape_text`` (a Python tuple literal) and holds no data."""
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape_text + ", }"
    header = header.ljust(118) + "\n"
    raw = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode()
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}.npy", raw)
    return path


def safetensors_claiming(path: Path, shape: list[int], dtype: str = "F32") -> Path:
    """A safetensors file whose header claims one tensor ``w`` of ``shape``; its data is a hole
    (a sparse file), so the file's size agrees with the header at no cost in disk space."""
    itemsize = {"F32": 4, "U8": 1}[dtype]
    nbytes = math.prod(shape) * itemsize
    raw = json.dumps({"w": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        fh.truncate(8 + len(raw) + nbytes)
    return path


_HUGE_SHAPES = [
    ([2**62], "16.0 EiB, more than the 2**63-1 bytes"),
    ([2**70], "dimension 1180591620717411303424"),
    ([0, 2**70], "dimension 1180591620717411303424"),  # no bytes, but no int64 can carry the shape
    ([2**31, 2**31, 4], "64.0 EiB, more than the 2**63-1 bytes"),
    ([2**40, 2**40], "4.0 YiB, more than the 2**63-1 bytes"),
    ([1] * 40, "40 dimensions; at most 32"),
]


@pytest.mark.parametrize(("shape", "says"), _HUGE_SHAPES)
def test_a_spec_shape_past_int64_is_one_model_error_naming_the_variable(tmp_path, shape, says):
    path = spec_file(tmp_path, [var("ok", [2]), var("w", shape)], name="model.json")
    raises_model_error(path, "model.json: variable 'w'", says)


@pytest.mark.parametrize(
    ("shape_text", "says"),
    [("(-1, 4)", "dimension -1"), ("(4, -3)", "dimension -3"),
     ("(99999999999999999999999,)", "dimension 99999999999999999999999"),
     ("(4611686018427387904, 4)", "64.0 EiB")],
)
def test_an_npz_header_with_a_negative_or_overflowing_shape_is_one_model_error(tmp_path, shape_text, says):
    raises_model_error(npz_with_header(tmp_path / "w.npz", shape_text), "w.npz: variable 'x'", says)


def test_a_safetensors_shape_past_int64_is_one_model_error(tmp_path):
    shape = [2**62]
    raw = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 2**64]}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    raises_model_error(path, "model.safetensors: tensor 'w'", "data_offsets end at")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st.lists(st.one_of(st.integers(-3, 3), st.integers(-(2**80), 2**80), st.sampled_from([2**31, 2**32, 2**62, 2**63])),
                   max_size=5),
    dtype=st.sampled_from(["float32", "float64", "uint8", "complex128"]),
)
def test_fuzz_any_integer_shape_loads_valid_or_fails_with_one_model_error(tmp_path, shape, dtype):
    """Whatever the shape, loading then the memory check give a valid model or one ModelError."""
    path = spec_file(tmp_path, [var("w", shape, dtype)], name="fuzz.json")
    try:
        source = load_source(str(path))
        (spec,) = source.specs()
        check_fits(source.specs(), spec.nbytes, label=str(path), available=1 << 30)
    except ModelError as exc:
        assert "\n" not in str(exc) and "'w'" in str(exc)
        return
    assert all(d >= 0 for d in spec.shape) and spec.nbytes <= 1 << 30
    # What loads must fit the wire: the plan carries every shape as int64.
    pb.VariableInfo(name=spec.name, shape=list(spec.shape), nbytes=spec.nbytes).SerializeToString()


def test_a_100_byte_spec_of_a_huge_tensor_is_refused_before_allocating(tmp_path):
    from collective.chief.arena import materialize

    path = spec_file(tmp_path, [var("w", [1000000, 1000000])], name="bomb.json")
    source = load_source(str(path))  # the spec itself is valid: only its size is not
    with pytest.raises(ModelError) as info:
        materialize(source, allocate=lambda n: pytest.fail(f"allocated {n} bytes"), max_bytes=1 << 40)
    message = str(info.value)
    assert "\n" not in message
    assert "bomb.json: variable 'w' is [1000000, 1000000] float32 = 3.6 TiB, more than --max-model-bytes 1.0 TiB" in message


def test_a_sparse_48_gib_safetensors_is_refused_against_available_memory(tmp_path):
    path = safetensors_claiming(tmp_path / "model.safetensors", [12 << 30], "F32")
    source = load_source(str(path))  # a consistent file: header, offsets and size agree
    (spec,) = source.specs()
    with pytest.raises(ModelError) as info:
        check_fits(source.specs(), spec.nbytes, label=source.description, available=22 << 30)
    assert str(info.value).startswith(
        f"{path}: variable 'w' is [12884901888] float32 = 48.0 GiB, more than the 22.0 GiB of memory available"
    )


def test_the_whole_model_is_checked_naming_its_largest_variable():
    specs = [VariableSpec(f"v{i}", (1 << 20,), "<f4") for i in range(3)] + [VariableSpec("big", (1 << 21,), "<f4")]
    with pytest.raises(ModelError) as info:
        check_fits(specs, 20 << 20, label="m.npz", available=16 << 20)
    assert "m.npz: the model's 4 variables need 20.0 MiB (largest: 'big' [2097152] float32 = 8.0 MiB)" in str(info.value)
    check_fits(specs, 20 << 20, label="m.npz", available=20 << 20)  # exactly enough is enough
    check_fits(specs, 20 << 20, label="m.npz", available=None)  # unknown (not Linux): not checked


def test_available_memory_reads_meminfo_and_leaves_headroom():
    free = available_memory()
    meminfo = Path("/proc/meminfo").read_text()
    total = int(next(line for line in meminfo.splitlines() if line.startswith("MemTotal:")).split()[1]) * 1024
    assert free is not None and 0 < free < total


@pytest.mark.parametrize("fmt", ["json", "safetensors"])
def test_a_name_with_a_lone_surrogate_is_refused_at_load_naming_it(tmp_path, fmt):
    if fmt == "json":
        path = tmp_path / "model.json"
        path.write_text('{"variables": [{"name": "a\\ud800b", "shape": [1], "dtype": "float32", "initializer": "zeros"}]}')
    else:
        path = write_safetensors(
            tmp_path / "model.safetensors", {"a\ud800b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\0"
        )
    raises_model_error(path, f"{path.name}: variable 'a\\ud800b': the name is not valid Unicode text", "character 1")


@pytest.mark.parametrize("order", [("x", "x/replica_1"), ("x/replica_12", "x")])
def test_a_variable_named_like_another_variables_replica_is_refused_naming_both(tmp_path, order):
    path = spec_file(tmp_path, [var(n, [2]) for n in order])
    replica = next(n for n in order if "/" in n)
    raises_model_error(path, f"variable {replica!r} is named like replica", "of variable 'x'")


def test_replica_like_names_without_their_variable_are_fine(tmp_path):
    names = ["x/replica_1", "y/replica_0", "y", "z/replica_01", "z", "w/replica_"]
    path = spec_file(tmp_path, [var(n, [1]) for n in [*names, "w"]])
    assert [s.name for s in load_source(str(path)).specs()] == [*names, "w"]


def test_npz_and_safetensors_names_are_checked_for_replica_clashes(tmp_path):
    np.savez(tmp_path / "w.npz", **{"x": np.zeros(1), "x/replica_2": np.zeros(1)})
    raises_model_error(tmp_path / "w.npz", "w.npz: variable 'x/replica_2' is named like replica 2 of variable 'x'")
    save_file({"b": np.zeros(1, np.float32), "b/replica_1": np.zeros(1, np.float32)}, str(tmp_path / "w.safetensors"))
    raises_model_error(tmp_path / "w.safetensors", "variable 'b/replica_1' is named like replica 1 of variable 'b'")


_ANY_INT = st.one_of(st.integers(-3, 8), st.integers(-(2**70), 2**70), st.sampled_from([2**31, 2**32, 2**62, 2**63, 2**64]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st.lists(_ANY_INT, max_size=4),
    offsets=st.lists(_ANY_INT, min_size=2, max_size=2),
    data=st.integers(0, 64),
    name=st.sampled_from(["w", "w/replica_1", "\ud800", "a\udfffb"]),
)
def test_fuzz_a_safetensors_header_loads_valid_or_fails_with_one_model_error(tmp_path, shape, offsets, data, name):
    header = {"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
              name: {"dtype": "F32", "shape": shape, "data_offsets": offsets}}
    raw = json.dumps(header).encode()  # json escapes a lone surrogate as \\udxxx, as a writer would
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * data)
    try:
        specs = load_source(str(path)).specs()
    except ModelError as exc:
        assert "\n" not in str(exc) and str(exc).startswith(f"{path}: ")
        return
    for spec in specs:  # what loads is a model the wire can carry
        pb.VariableInfo(name=spec.name, shape=list(spec.shape), nbytes=spec.nbytes).SerializeToString()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.lists(_ANY_INT, max_size=4))
def test_fuzz_an_npz_header_loads_valid_or_fails_with_one_model_error(tmp_path, shape):
    path = npz_with_header(tmp_path / "fuzz.npz", repr(tuple(shape)))
    try:
        specs = load_source(str(path)).specs()
    except ModelError as exc:
        assert "\n" not in str(exc) and "fuzz.npz" in str(exc)
        return
    for spec in specs:
        pb.VariableInfo(name=spec.name, shape=list(spec.shape), nbytes=spec.nbytes).SerializeToString()


# ----------------------------------------------------------------------------- rejected values, quoted


def test_quoted_formats_a_bounded_part_of_any_value():
    """A message quotes at most a short prefix: the value of a YAML alias bomb shares its lists,
    so it is small in memory but 9**9 values once formatted whole."""
    bomb: object = ["x"] * 9
    for _ in range(8):
        bomb = [bomb] * 9
    assert quoted(bomb) == "[" + ", ".join(["[...]"] * 8) + ", ...]"
    assert quoted({"a": bomb, "b": 1}) == "{'a': [...], 'b': 1}"
    assert quoted("s" * 1000) == repr("s" * 80) + "...(1000 characters)"
    assert quoted(int("9" * 4000)) == "<an integer of 4000 digits>"
    assert quoted(16 ** 5000) == "<an integer of 6021 digits>"  # past what str() can format
    assert [quoted(v) for v in (True, None, -3, 2**70, 0.5, "ok", [1, 2])] == \
        ["True", "None", "-3", "1180591620717411303424", "0.5", "'ok'", "[1, 2]"]


def test_a_non_scalar_rejected_value_is_quoted_briefly(tmp_path):
    """Issue 28 item 5: below the alias limit, but each value still formatted whole before."""
    path = tmp_path / "model.yaml"
    path.write_text("variables:\n  - name: w\n    shape: [1]\n    dtype: float32\n    initializer: zeros\n"
                    "    trainable: {a: &a [x, x, x, x, x, x, x, x, x], b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]}\n")
    error = raises_model_error(path, "variable 'w': trainable must be true or false, not {'a': [...], 'b': [...]}")
    assert len(str(error)) < 200


@pytest.mark.parametrize(("text", "says"), [
    ("seed: &s [1, *s]\nvariables: []\n", "line 1, column 7: found a recursive alias"),
    ("x: &a [y, y, y, y, y, y, y, y, y, y]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcde", "bcdef", strict=True)),
     "line 5, column 4: aliases expand the document's 23 nodes to 1234573, more than 100230"),
], ids=["recursive", "expanding"])
def test_yaml_aliases_that_recurse_or_expand_far_are_refused(tmp_path, text, says):
    path = tmp_path / "model.yaml"
    path.write_text(text)
    raises_model_error(path, "model.yaml: invalid YAML at ", says)


def test_yaml_anchors_shared_by_many_variables_still_load(tmp_path):
    """Merge keys and shared initializers expand a document a few times over, never 10 times."""
    lines = ["variables:", "  - &base {name: v0, shape: [2, 2], dtype: float32, initializer: &init {type: normal, stddev: 0.1}}"]
    lines += [f"  - {{<<: *base, name: v{i}, initializer: *init}}" for i in range(1, 20000)]
    path = tmp_path / "model.yaml"
    path.write_text("\n".join(lines) + "\n")
    assert len(load_source(path).specs()) == 20000


@pytest.mark.parametrize(("value", "says"), [
    ("2024-13-01", "invalid date '2024-13-01': month must be in 1..12"),
    ("0b" + "1" * 5000, "integer 0b1111111111... has 5002 characters, more than the 4300"),
], ids=["date", "binary-integer"])
def test_yaml_scalars_python_cannot_read_are_one_model_error(tmp_path, value, says):
    path = tmp_path / "model.yaml"
    path.write_text(f"variables:\n  - name: w\n    shape: [{value}]\n    dtype: float32\n    initializer: zeros\n")
    raises_model_error(path, "model.yaml: invalid YAML at line 3, column 13: ", says)


@pytest.mark.parametrize("fmt", ["json", "safetensors"])
def test_a_rejected_name_of_a_megabyte_is_quoted_by_a_prefix(tmp_path, fmt):
    name = "n" * (1 << 20)
    if fmt == "json":
        path = write_json(tmp_path / "model.json", {"variables": [var(name, [1], "float128")]})
    else:
        path = write_safetensors(tmp_path / "model.safetensors", {name: {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}},
                                 b"\0" * 16)
    error = raises_model_error(path, f"{'n' * 80!r}...(1048576 characters)")
    assert len(str(error)) < 600  # the path, the name's prefix and the dtype hint; was a megabyte
