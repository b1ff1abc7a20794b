"""Spec sources: seeded initializers, YAML/JSON variable specs and the presets."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
import yaml

from collective import dtypes as dtypemod
from collective.errors import ModelError
from collective.model import Aggregation, Synchronization, VariableSpec, quoted
from collective.sources._common import (
    RANDOM_BLOCK_ELEMENTS,
    _check_name,
    _check_out,
    _check_seed,
    _is_int,
    _is_number,
    _json_loads,
    _parse_dtype,
    _parse_shape,
    _Problem,
)
from collective.sources._yaml import load_yaml, yaml_error_message

PRESETS: tuple[str, ...] = ("mlp", "transformer-100m")
"""Canonical preset names, in the order they are listed to users."""

PRESET_ALIASES: dict[str, str] = {"transformer": "transformer-100m"}


# --------------------------------------------------------------------------------------------
# Initializers
# --------------------------------------------------------------------------------------------

_RANDOM_INITIALIZERS = ("uniform", "normal", "truncated_normal", "glorot_uniform", "he_normal")

INITIALIZERS: dict[str, dict[str, float | None]] = {
    "zeros": {},
    "ones": {},
    "constant": {"value": None},  # None: required
    "uniform": {"minval": -0.05, "maxval": 0.05},
    "normal": {"mean": 0.0, "stddev": 0.05},
    "truncated_normal": {"mean": 0.0, "stddev": 0.05},
    "glorot_uniform": {},
    "he_normal": {},
}
"""Initializer names and their parameters with defaults (None marks a required parameter)."""

_INITIALIZER_ALIASES = {"random_uniform": "uniform", "random_normal": "normal"}

# Keras' VarianceScaling divides by this so the truncated normal has the requested stddev:
# the standard deviation of a unit normal truncated to [-2, 2].
_TRUNCATED_STDDEV_CORRECTION = 0.87962566103423978


def keras_fans(shape: Sequence[int]) -> tuple[int, int]:
    """``(fan_in, fan_out)`` as Keras computes them."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive_field = math.prod(shape[:-2])
    return shape[-2] * receptive_field, shape[-1] * receptive_field


@dataclass(frozen=True)
class Initializer:
    """A resolved initializer: glorot_uniform and he_normal become uniform / truncated_normal
    with parameters computed from the variable's shape."""

    name: str  # as written (normalised), e.g. "glorot_uniform"
    kind: str  # zeros | ones | constant | uniform | normal | truncated_normal
    value: Any = 0
    low: float = 0.0
    high: float = 0.0
    mean: float = 0.0
    stddev: float = 0.0

    @property
    def is_random(self) -> bool:
        return self.kind in ("uniform", "normal", "truncated_normal")

    def fill(self, out: np.ndarray, rng: Callable[[], np.random.Generator]) -> None:
        if self.kind == "zeros":
            out.fill(0)
        elif self.kind == "ones":
            out.fill(1)
        elif self.kind == "constant":
            out.fill(self.value)
        else:
            _fill_random(out, rng(), self._draw)

    def _draw(self, rng: np.random.Generator, block: np.ndarray, scratch: np.ndarray) -> None:
        dtype = block.dtype.type
        if self.kind == "uniform":
            rng.random(out=block, dtype=dtype)
            block *= dtype(self.high - self.low)
            block += dtype(self.low)
            return
        rng.standard_normal(out=block, dtype=dtype)
        if self.kind == "truncated_normal":
            # Like TensorFlow: values more than 2 stddev from the mean are re-drawn.
            magnitude = np.abs(block, out=scratch[: block.size])
            bad = np.flatnonzero(magnitude > 2)
            while bad.size:
                fresh = rng.standard_normal(bad.size, dtype=dtype)
                ok = np.abs(fresh) <= 2
                block[bad[ok]] = fresh[ok]
                bad = bad[~ok]
        block *= dtype(self.stddev)
        block += dtype(self.mean)


def _fill_random(
    out: np.ndarray,
    rng: np.random.Generator,
    draw: Callable[[np.random.Generator, np.ndarray, np.ndarray], None],
) -> None:
    flat = out.reshape(-1)  # a view: out is C-contiguous
    n = flat.size
    if n == 0:
        return
    gen_dtype = np.dtype(np.float64) if out.dtype.itemsize == 8 else np.dtype(np.float32)
    # Native, aligned float32/float64: generate straight into out; else via a block-sized temp.
    direct = out.dtype == gen_dtype and out.flags.aligned
    block_len = min(RANDOM_BLOCK_ELEMENTS, n)
    scratch = np.empty(block_len, gen_dtype)
    temp = None if direct else np.empty(block_len, gen_dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, n, RANDOM_BLOCK_ELEMENTS):
            stop = min(start + RANDOM_BLOCK_ELEMENTS, n)
            if direct:
                draw(rng, flat[start:stop], scratch)
            else:
                assert temp is not None
                block = temp[: stop - start]
                draw(rng, block, scratch)
                flat[start:stop] = block


def variable_rng(seed: int, name: str) -> np.random.Generator:
    """The generator a spec source uses for variable ``name`` under ``seed``."""
    key = xxhash.xxh64_intdigest(name.encode("utf-8"))
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, key])))


def _param(init: str, key: str, value: object) -> float:
    if not _is_number(value) or not math.isfinite(float(value)):  # type: ignore[arg-type]
        raise _Problem(f"initializer {init!r}: parameter {key!r} must be a finite number, not {quoted(value)}")
    return float(value)  # type: ignore[arg-type]


def _constant_value(dtype: np.dtype, value: object) -> Any:
    bad = f"initializer 'constant': value {quoted(value)} does not fit dtype {dtype.name}"
    if dtype.kind == "b":
        if isinstance(value, bool | np.bool_) or (_is_int(value) and int(value) in (0, 1)):  # type: ignore[call-overload]
            return bool(value)
        raise _Problem(bad)
    if dtype.kind in "iu":
        if _is_number(value) and not _is_int(value):
            if not math.isfinite(float(value)) or not float(value).is_integer():  # type: ignore[arg-type]
                raise _Problem(bad)
            value = int(float(value))  # type: ignore[arg-type]
        if not _is_int(value):
            raise _Problem(bad)
        info = np.iinfo(dtype)
        if not info.min <= int(value) <= info.max:  # type: ignore[call-overload]
            raise _Problem(bad)
        return int(value)  # type: ignore[call-overload]
    # float and complex
    if not _is_number(value):
        raise _Problem(bad)
    try:
        number = float(value)  # type: ignore[arg-type]
    except OverflowError as exc:
        raise _Problem(bad) from exc
    if math.isfinite(number) and abs(number) > float(dtypemod.finfo(dtype).max):
        raise _Problem(bad)
    return number


def _parse_initializer(value: object, shape: tuple[int, ...], dtype: np.dtype) -> Initializer:
    if isinstance(value, str):
        raw_name, params = value, {}
    elif isinstance(value, Mapping):
        if "type" not in value:
            raise _Problem(f"initializer mapping needs a 'type' (one of: {', '.join(INITIALIZERS)})")
        raw_name = value["type"]
        params = {k: v for k, v in value.items() if k != "type"}
        if not isinstance(raw_name, str):
            raise _Problem(f"initializer type must be a string, not {quoted(raw_name)}")
    else:
        raise _Problem(
            f"initializer must be a name or a mapping with 'type', not {quoted(value)}; "
            f"use one of: {', '.join(INITIALIZERS)}"
        )
    name = raw_name.strip().lower()
    name = _INITIALIZER_ALIASES.get(name, name)
    if name not in INITIALIZERS:
        raise _Problem(f"unknown initializer {quoted(raw_name)}; use one of: {', '.join(INITIALIZERS)}")
    allowed = INITIALIZERS[name]
    for key in params:
        if key not in allowed:
            hint = f"use {', '.join(allowed)}" if allowed else "it takes no parameters"
            raise _Problem(f"initializer {name!r}: unknown parameter {quoted(key)}; {hint}")
    if name in _RANDOM_INITIALIZERS and not dtypemod.is_float(dtype):
        raise _Problem(f"initializer {name!r} needs a float dtype, not {dtype.name}")

    if name in ("zeros", "ones"):
        return Initializer(name, name)
    if name == "constant":
        if "value" not in params:
            raise _Problem("initializer 'constant' needs a 'value'")
        return Initializer(name, "constant", value=_constant_value(dtype, params["value"]))

    largest = float(dtypemod.finfo(dtype).max)
    gen_largest = float(np.finfo(np.float64 if dtype.itemsize == 8 else np.float32).max)

    def representable(key: str, number: float, limit: float = largest) -> float:
        if abs(number) > limit:
            raise _Problem(f"initializer {name!r}: {key} {number!r} is out of range for {dtype.name}")
        return number

    values = {
        key: _param(name, key, params.get(key, default)) for key, default in allowed.items()
    }
    if name == "uniform":
        low = representable("minval", values["minval"])
        high = representable("maxval", values["maxval"])
        if low > high:
            raise _Problem(f"initializer 'uniform': minval {low!r} is greater than maxval {high!r}")
        representable("maxval - minval", high - low, gen_largest)
        return Initializer(name, "uniform", low=low, high=high)
    if name in ("normal", "truncated_normal"):
        mean = representable("mean", values["mean"])
        stddev = representable("stddev", values["stddev"])
        if stddev < 0:
            raise _Problem(f"initializer {name!r}: stddev {stddev!r} is negative")
        return Initializer(name, name, mean=mean, stddev=stddev)

    fan_in, fan_out = keras_fans(shape)
    if name == "glorot_uniform":
        limit = math.sqrt(3.0 / max(1.0, (fan_in + fan_out) / 2.0))  # = sqrt(6 / (fan_in + fan_out))
        return Initializer(name, "uniform", low=-limit, high=limit)
    # he_normal
    stddev = math.sqrt(2.0 / max(1.0, fan_in)) / _TRUNCATED_STDDEV_CORRECTION
    return Initializer(name, "truncated_normal", stddev=stddev)


# --------------------------------------------------------------------------------------------
# Spec sources (YAML / JSON / presets)
# --------------------------------------------------------------------------------------------

_TOP_KEYS = ("seed", "variables")
_REQUIRED_KEYS = ("name", "shape", "dtype", "initializer")
_ENTRY_KEYS = (*_REQUIRED_KEYS, "synchronization", "aggregation", "trainable")


@dataclass(frozen=True)
class _SpecEntry:
    spec: VariableSpec
    initializer: Initializer


def _parse_entry(index: int, entry: object) -> _SpecEntry:
    """Parse variable #index (1-based); raises _Problem with a ``variable ...:`` prefix."""
    where = f"variable #{index}"
    try:
        if not isinstance(entry, Mapping):
            raise _Problem(
                f"expected a mapping with {', '.join(_REQUIRED_KEYS)}, not {type(entry).__name__}"
            )
        if "name" in entry:
            name = _check_name(entry["name"])
            where = f"variable {quoted(name)}"
        for key in entry:
            if key not in _ENTRY_KEYS:
                raise _Problem(f"unknown key {quoted(key)}; use {', '.join(_ENTRY_KEYS)}")
        for key in _REQUIRED_KEYS:
            if key not in entry:
                raise _Problem(f"missing {key!r}")
        shape = _parse_shape(entry["shape"])
        dtype = _parse_dtype(entry["dtype"])
        initializer = _parse_initializer(entry["initializer"], shape, dtype)
        sync_value = entry.get("synchronization")
        agg_value = entry.get("aggregation")
        try:
            sync = Synchronization.AUTO if sync_value is None else Synchronization.parse(sync_value)
            agg = Aggregation.NONE if agg_value is None else Aggregation.parse(agg_value)
        except ValueError as exc:
            raise _Problem(str(exc)) from exc
        trainable = entry.get("trainable")
        if trainable is not None and not isinstance(trainable, bool):
            raise _Problem(f"trainable must be true or false, not {quoted(trainable)}")
        # The variable rules of collective.variables, checked here so that a bad spec fails on
        # the chief at load time rather than on every worker after the broadcast.
        if sync is Synchronization.NONE:
            raise _Problem("synchronization NONE is not allowed; use auto, on_write or on_read")
        if sync is Synchronization.ON_READ and trainable is True:
            raise _Problem("an on_read (sync-on-read) variable cannot be trainable")
    except _Problem as exc:
        raise _Problem(f"{where}: {exc}") from exc
    spec = VariableSpec(name, shape, dtypemod.wire(dtype), sync, agg, trainable)  # type: ignore[arg-type]
    return _SpecEntry(spec, initializer)


class SpecSource:
    """Variables described by a spec document (a mapping with ``seed`` and ``variables``).

    The document is the parsed YAML/JSON (or an in-memory mapping, as for presets); it is
    validated on the first ``specs()`` call. ``label`` prefixes error messages.
    """

    def __init__(
        self,
        document: object = None,
        *,
        label: str = "spec",
        description: str | None = None,
        seed: int | None = None,
    ) -> None:
        self._raw = document
        self.label = label
        self.description = description if description is not None else label
        self._seed_override = None if seed is None else _check_seed(seed, where=f"{label}: seed")
        self._entries: dict[str, _SpecEntry] | None = None
        self._seed: int | None = None

    def _document(self) -> object:
        return self._raw

    @property
    def seed(self) -> int:
        """The effective seed (the override if given, else the spec's ``seed``)."""
        self._parsed()
        assert self._seed is not None
        return self._seed

    def _parsed(self) -> dict[str, _SpecEntry]:
        if self._entries is None:
            self._entries = self._parse(self._document())
        return self._entries

    def _parse(self, document: object) -> dict[str, _SpecEntry]:
        label = self.label
        if document is None:
            raise ModelError(f"{label}: empty spec; expected a mapping with 'seed' and 'variables'")
        if not isinstance(document, Mapping):
            raise ModelError(
                f"{label}: expected a mapping with 'seed' and 'variables' at the top level, "
                f"not {type(document).__name__}"
            )
        for key in document:
            if key not in _TOP_KEYS:
                raise ModelError(f"{label}: unknown top-level key {quoted(key)}; use {', '.join(_TOP_KEYS)}")
        seed = _check_seed(document.get("seed", 0), where=f"{label}: seed")
        self._seed = self._seed_override if self._seed_override is not None else seed
        if "variables" not in document:
            raise ModelError(f"{label}: missing 'variables' (a list of variable entries)")
        variables = document["variables"]
        if not isinstance(variables, list | tuple):
            raise ModelError(f"{label}: 'variables' must be a list, not {type(variables).__name__}")
        if not variables:
            raise ModelError(f"{label}: 'variables' is empty; a model needs at least one variable")
        entries: dict[str, _SpecEntry] = {}
        for index, raw in enumerate(variables, start=1):
            try:
                entry = _parse_entry(index, raw)
            except _Problem as exc:
                raise ModelError(f"{label}: {exc}") from exc
            name = entry.spec.name
            if name in entries:
                raise ModelError(f"{label}: variable {quoted(name)}: duplicate name (entry #{index})")
            entries[name] = entry
        return entries

    def specs(self) -> list[VariableSpec]:
        return [entry.spec for entry in self._parsed().values()]

    def initializer(self, name: str) -> Initializer:
        """The resolved initializer of variable ``name``."""
        return self._parsed()[name].initializer

    def fill(self, spec: VariableSpec, out: np.ndarray) -> None:
        entries = self._parsed()
        entry = entries.get(spec.name)
        if entry is None:
            raise ValueError(f"{self.label}: no variable {spec.name!r}")
        _check_out(self.label, entry.spec, out)
        seed = self.seed
        entry.initializer.fill(out, lambda: variable_rng(seed, spec.name))


class SpecFileSource(SpecSource):
    """A spec read from a ``.yaml``/``.yml`` (YAML) or ``.json`` (JSON) file."""

    def __init__(self, path: str | os.PathLike[str], *, label: str | None = None, seed: int | None = None):
        self.path = Path(path)
        label = label if label is not None else os.fspath(path)
        super().__init__(None, label=label, description=label, seed=seed)

    def _document(self) -> object:
        label = self.label
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise ModelError(f"{label}: cannot read: {exc.strerror or exc}") from exc
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise ModelError(f"{label}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        if self.path.suffix.lower() == ".json":
            try:
                return _json_loads(text)
            except json.JSONDecodeError as exc:
                raise ModelError(
                    f"{label}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
                ) from exc
            except _Problem as exc:
                raise ModelError(f"{label}: invalid JSON: {exc}") from exc
            except RecursionError as exc:
                raise ModelError(f"{label}: invalid JSON: nested too deeply") from exc
        try:
            return load_yaml(text)
        except yaml.YAMLError as exc:
            raise ModelError(f"{label}: {yaml_error_message(exc)}") from exc
        except RecursionError as exc:
            raise ModelError(f"{label}: invalid YAML: nested too deeply") from exc


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------


def _global_step() -> dict[str, Any]:
    # As tf.compat.v1.train.get_or_create_global_step creates it.
    return {
        "name": "global_step",
        "shape": [],
        "dtype": "int64",
        "initializer": "zeros",
        "trainable": False,
        "aggregation": "only_first_replica",
    }


def _dense(name: str, n_in: int, n_out: int, kernel_init: object = "glorot_uniform") -> list[dict]:
    return [
        {"name": f"{name}/kernel", "shape": [n_in, n_out], "dtype": "float32", "initializer": kernel_init},
        {"name": f"{name}/bias", "shape": [n_out], "dtype": "float32", "initializer": "zeros"},
    ]


def _layer_norm(name: str, width: int) -> list[dict]:
    return [
        {"name": f"{name}/gamma", "shape": [width], "dtype": "float32", "initializer": "ones"},
        {"name": f"{name}/beta", "shape": [width], "dtype": "float32", "initializer": "zeros"},
    ]


def _mlp_document() -> dict[str, Any]:
    variables: list[dict] = []
    for name, n_in, n_out in (("dense_1", 784, 256), ("dense_2", 256, 128), ("dense_3", 128, 10)):
        variables += _dense(name, n_in, n_out)
    variables.append(_global_step())
    return {"seed": 0, "variables": variables}


def _transformer_document(
    vocab: int = 16384, context: int = 1024, width: int = 768, layers: int = 12, hidden: int = 3072
) -> dict[str, Any]:
    embedding_init = {"type": "truncated_normal", "stddev": 0.02}
    variables: list[dict] = [
        {"name": "embeddings/token", "shape": [vocab, width], "dtype": "float32", "initializer": embedding_init},
        {"name": "embeddings/position", "shape": [context, width], "dtype": "float32", "initializer": embedding_init},
    ]
    for i in range(layers):
        layer = f"layer_{i:02d}"
        for part in ("query", "key", "value", "output"):
            variables += _dense(f"{layer}/attention/{part}", width, width)
        variables += _layer_norm(f"{layer}/attention_norm", width)
        variables += _dense(f"{layer}/mlp/dense_1", width, hidden)
        variables += _dense(f"{layer}/mlp/dense_2", hidden, width)
        variables += _layer_norm(f"{layer}/mlp_norm", width)
    variables += _layer_norm("final_norm", width)
    variables.append(_global_step())
    return {"seed": 0, "variables": variables}


_PRESET_BUILDERS: dict[str, Callable[[], dict[str, Any]]] = {
    "mlp": _mlp_document,
    "transformer-100m": _transformer_document,
}


def _unknown_model_message(ref: str) -> str:
    return (
        f"model {ref!r}: no such file or preset; use a .yaml/.json spec, .npz, .safetensors "
        f"or one of: {', '.join(PRESETS)}"
    )


def preset_document(name: str) -> dict[str, Any]:
    """The spec document of preset ``name`` (or an alias), as a YAML/JSON spec would hold it."""
    key = PRESET_ALIASES.get(name, name)
    if key not in _PRESET_BUILDERS:
        raise ModelError(_unknown_model_message(name))
    return _PRESET_BUILDERS[key]()


def _preset_source(name: str, seed: int | None) -> SpecSource:
    document = preset_document(name)
    effective = document["seed"] if seed is None else seed
    return SpecSource(
        document, label=f"preset {name}", description=f"preset {name} (seed {effective})", seed=seed
    )
