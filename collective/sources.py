"""Model sources: where the chief's initial variable values come from.

``load_source(ref)`` turns what the user typed into a ``ModelSource``:

* a preset name: ``mlp`` (small demo model) or ``transformer-100m`` (alias ``transformer``);
* a variable spec in YAML (``.yaml``/``.yml``) or JSON (``.json``), whose values are produced by
  seeded initializers;
* a ``.npz`` archive (``numpy.savez``) or a ``.safetensors`` file, whose arrays are the values.

bfloat16 and float8 values (``ml_dtypes``; see ``collective.dtypes``) come from safetensors
(``BF16``, ``F8_E4M3``, ``F8_E5M2``...), from specs (``dtype: bfloat16``) and from .npz archives.
numpy writes an ``ml_dtypes`` array into a .npy member as raw void bytes (``<V2``), losing its
type, so an archive names the types of such members in a ``__dtypes__`` member (a unicode
scalar holding a JSON object ``{"name": "bfloat16"}``), as ``save_npz`` writes it; the member's
bytes stay plain raw void that any numpy reads. A raw void member without such an entry is
refused.

Every source validates its input in ``specs()``, which ``load_source`` calls eagerly, so a bad
file fails at load time with one ``ModelError`` line naming the file and the entry at fault.
``fill(spec, out)`` then writes one variable's value into a caller-provided C-contiguous buffer
without materialising a second full-size copy (random values are generated and files are read
in bounded blocks).

Determinism of spec sources: variable ``name`` of a spec with seed ``seed`` draws from
``Generator(PCG64(SeedSequence([seed, xxh64_intdigest(name.encode("utf-8"))])))``, so a value
depends only on the seed, the variable's name and its own entry (not on the other variables or
their order). float32/float64 values are generated in that dtype; float16 and non-native byte
orders are generated in float32/float64 and then cast. Uniform and normal draws do not depend
on the block size; the truncated normal re-draws rejected values per block of
``RANDOM_BLOCK_ELEMENTS`` elements, which is therefore part of the format and fixed.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import warnings
import zipfile
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import xxhash
import yaml

from collective import dtypes as dtypemod
from collective.errors import ModelError
from collective.model import Aggregation, ModelSource, Synchronization, VariableSpec, validate_model

__all__ = [
    "Initializer",
    "keras_fans",
    "INITIALIZERS",
    "PRESETS",
    "PRESET_ALIASES",
    "RANDOM_BLOCK_ELEMENTS",
    "NpzSource",
    "SafetensorsSource",
    "SpecFileSource",
    "SpecSource",
    "load_source",
    "preset_document",
    "preset_names",
    "save_npz",
    "variable_rng",
]

PRESETS: tuple[str, ...] = ("mlp", "transformer-100m")
"""Canonical preset names, in the order they are listed to users."""

PRESET_ALIASES: dict[str, str] = {"transformer": "transformer-100m"}

SPEC_SUFFIXES = (".yaml", ".yml", ".json")
NPZ_SUFFIX = ".npz"
SAFETENSORS_SUFFIX = ".safetensors"

RANDOM_BLOCK_ELEMENTS = 1 << 20
"""Random values are generated this many elements at a time (part of the determinism contract)."""

_IO_CHUNK_BYTES = 1 << 20
_SAFETENSORS_MAX_HEADER = 100_000_000  # the limit the safetensors library enforces

_KINDS_HINT = dtypemod.KINDS_HINT
_dtype_problem = dtypemod.problem


def preset_names() -> tuple[str, ...]:
    """The canonical preset names (aliases such as ``transformer`` are not listed)."""
    return PRESETS


def _unknown_model_message(ref: str) -> str:
    return (
        f"model {ref!r}: no such file or preset; use a .yaml/.json spec, .npz, .safetensors "
        f"or one of: {', '.join(PRESETS)}"
    )


def load_source(ref: str | os.PathLike[str], *, seed: int | None = None) -> ModelSource:
    """Open the model ``ref`` (a preset name or a spec/.npz/.safetensors path) and validate it.

    ``seed`` overrides the spec's (or preset's) seed; it has no effect on .npz and .safetensors
    files, whose values are stored. Raises ModelError for an unknown preset, a missing,
    unreadable or invalid file, or an invalid seed, and for variables no transport could carry
    (``collective.model.check_specs``: names that are not UTF-8, shapes past int64, a name
    that is another variable's replica name).
    """
    ref = os.fspath(ref)
    if seed is not None:
        seed = _check_seed(seed, where="seed")
    source = _open(ref, seed)
    validate_model(source.specs(), label=source.description)
    return source


def _open(ref: str, seed: int | None) -> ModelSource:
    key = ref.strip().lower()
    preset = PRESET_ALIASES.get(key, key)
    if preset in PRESETS:
        return _preset_source(preset, seed)
    path = Path(ref).expanduser()
    if not path.exists():
        raise ModelError(_unknown_model_message(ref))
    if path.is_dir():
        raise ModelError(
            f"model {ref!r}: is a directory; use a .yaml/.json spec, .npz or .safetensors file"
        )
    suffix = path.suffix.lower()
    if suffix in SPEC_SUFFIXES:
        return SpecFileSource(path, label=ref, seed=seed)
    if suffix == NPZ_SUFFIX:
        return NpzSource(path, label=ref)
    if suffix == SAFETENSORS_SUFFIX:
        return SafetensorsSource(path, label=ref)
    kind = f"type {suffix!r}" if suffix else "type (no suffix)"
    raise ModelError(
        f"model {ref!r}: unsupported file {kind}; use a .yaml/.json spec, .npz, .safetensors "
        f"or one of: {', '.join(PRESETS)}"
    )


# --------------------------------------------------------------------------------------------
# Shared validation helpers
# --------------------------------------------------------------------------------------------


class _Problem(Exception):
    """A validation problem; the caller prefixes the file and entry to make a ModelError."""


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def _check_seed(value: object, *, where: str) -> int:
    if not _is_int(value) or int(value) < 0:  # type: ignore[call-overload]
        raise ModelError(f"{where} must be a non-negative integer, not {value!r}")
    return int(value)  # type: ignore[call-overload]


def _parse_dtype(value: object) -> np.dtype:
    if not isinstance(value, str) or not value.strip():
        raise _Problem(f"dtype must be a numpy dtype name such as 'float32', not {value!r}")
    extended = dtypemod.by_name(value.strip())
    if extended is not None:
        return extended
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # deprecated aliases count as unknown
            dtype = np.dtype(value.strip())
    except (TypeError, ValueError, Warning) as exc:
        if dtypemod.is_ml_dtypes_name(value.strip()):  # numpy knows it only once ml_dtypes is imported
            raise _Problem(f"unsupported dtype {value.strip()!r}; {_KINDS_HINT}") from exc
        raise _Problem(f"unknown dtype {value!r}; {_KINDS_HINT}") from exc
    problem = _dtype_problem(dtype)
    if problem:
        raise _Problem(problem)
    return dtype


def _parse_shape(value: object) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise _Problem(f"shape must be a list of non-negative integers ([] for a scalar), not {value!r}")
    for dim in value:
        if not _is_int(dim) or int(dim) < 0:
            raise _Problem(f"shape {list(value)!r}: dimension {dim!r} is not a non-negative integer")
    return tuple(int(d) for d in value)


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise _Problem(f"name must be a non-empty string, not {name!r}")
    if not name:
        raise _Problem("empty variable name")
    return name


def _check_out(label: str, spec: VariableSpec, out: np.ndarray) -> None:
    """The buffer contract of ``fill``; a violation is a programming error (ValueError)."""
    if not isinstance(out, np.ndarray):
        raise ValueError(f"{label}: variable {spec.name!r}: out must be a numpy array")
    if out.shape != spec.shape or out.dtype != spec.np_dtype:
        raise ValueError(
            f"{label}: variable {spec.name!r}: out is {out.shape} {dtypemod.wire(out.dtype)}, "
            f"expected {spec.shape} {spec.dtype}"
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{label}: variable {spec.name!r}: out must be C-contiguous and writeable")


def _byte_view(out: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (works for 0-d arrays and any byte order)."""
    return out.reshape(-1).view(np.uint8)


def _no_duplicate_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _Problem(f"duplicate key {key!r}")
        result[key] = value
    return result


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


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
        raise _Problem(f"initializer {init!r}: parameter {key!r} must be a finite number, not {value!r}")
    return float(value)  # type: ignore[arg-type]


def _constant_value(dtype: np.dtype, value: object) -> Any:
    bad = f"initializer 'constant': value {value!r} does not fit dtype {dtype.name}"
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
            raise _Problem(f"initializer type must be a string, not {raw_name!r}")
    else:
        raise _Problem(
            f"initializer must be a name or a mapping with 'type', not {value!r}; "
            f"use one of: {', '.join(INITIALIZERS)}"
        )
    name = raw_name.strip().lower()
    name = _INITIALIZER_ALIASES.get(name, name)
    if name not in INITIALIZERS:
        raise _Problem(f"unknown initializer {raw_name!r}; use one of: {', '.join(INITIALIZERS)}")
    allowed = INITIALIZERS[name]
    for key in params:
        if key not in allowed:
            hint = f"use {', '.join(allowed)}" if allowed else "it takes no parameters"
            raise _Problem(f"initializer {name!r}: unknown parameter {key!r}; {hint}")
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
            where = f"variable {name!r}"
        for key in entry:
            if key not in _ENTRY_KEYS:
                raise _Problem(f"unknown key {key!r}; use {', '.join(_ENTRY_KEYS)}")
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
            raise _Problem(f"trainable must be true or false, not {trainable!r}")
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
                raise ModelError(f"{label}: unknown top-level key {key!r}; use {', '.join(_TOP_KEYS)}")
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
                raise ModelError(f"{label}: variable {name!r}: duplicate name (entry #{index})")
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


class _StrictYamlLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """SafeLoader that rejects duplicate mapping keys instead of keeping the last one.

    Built on libyaml's parser when PyYAML has it (its wheels do): a spec of 20,000 variables
    then loads in about 1.4 s instead of 5.3 s.
    """


def _construct_strict_mapping(loader: _StrictYamlLoader, node: yaml.MappingNode) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # unhashable: construct_mapping reports it
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r}",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictYamlLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_strict_mapping
)


def _yaml_error_message(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        problem = exc.problem or exc.context or "syntax error"
        return f"invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {_one_line(problem)}"
    return f"invalid YAML: {_one_line(str(exc))}"


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
                return json.loads(text, object_pairs_hook=_no_duplicate_pairs)
            except json.JSONDecodeError as exc:
                raise ModelError(
                    f"{label}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
                ) from exc
            except _Problem as exc:
                raise ModelError(f"{label}: invalid JSON: {exc}") from exc
            except RecursionError as exc:
                raise ModelError(f"{label}: invalid JSON: nested too deeply") from exc
        try:
            return yaml.load(text, Loader=_StrictYamlLoader)  # a SafeLoader subclass
        except yaml.YAMLError as exc:
            raise ModelError(f"{label}: {_yaml_error_message(exc)}") from exc
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


# --------------------------------------------------------------------------------------------
# Stored values: .npz and .safetensors
# --------------------------------------------------------------------------------------------


def _readinto_exact(f: BinaryIO, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            raise EOFError(f"data is truncated: expected {len(view)} more bytes, got {got}")
        got += n


def _read_exact(f: BinaryIO, size: int) -> bytearray:
    buf = bytearray(size)
    _readinto_exact(f, memoryview(buf))
    return buf


def _read_c_order(f: BinaryIO, out: np.ndarray) -> None:
    """Read ``out.nbytes`` raw bytes from ``f`` into ``out`` in bounded chunks."""
    dest = _byte_view(out)
    for start in range(0, dest.size, _IO_CHUNK_BYTES):
        _readinto_exact(f, memoryview(dest[start : start + _IO_CHUNK_BYTES]))


def _read_fortran_order(f: BinaryIO, out: np.ndarray) -> None:
    """Read Fortran-ordered data: it is C-ordered data of ``out.T``, read a few rows at a time."""
    target = out.T
    row_shape = target.shape[1:]
    row_bytes = math.prod(row_shape) * out.dtype.itemsize
    rows = max(1, _IO_CHUNK_BYTES // row_bytes)
    for k in range(0, target.shape[0], rows):
        m = min(rows, target.shape[0] - k)
        buf = _read_exact(f, m * row_bytes)
        target[k : k + m] = np.frombuffer(buf, dtype=out.dtype).reshape((m, *row_shape))


_NPZ_READ_ERRORS = (
    OSError,
    EOFError,
    ValueError,
    KeyError,
    RuntimeError,
    NotImplementedError,
    zipfile.BadZipFile,
    zlib.error,
)


def _read_npy_header(f: BinaryIO) -> tuple[tuple[int, ...], bool, np.dtype]:
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(f)
    raise ValueError(f"unsupported .npy format version {version[0]}.{version[1]}")


@dataclass(frozen=True)
class _NpzEntry:
    member: str
    fortran_order: bool
    spec: VariableSpec
    stored: str  # the member's header dtype (``<V2`` for a bfloat16 stored as raw void)


NPZ_DTYPES_MEMBER = "__dtypes__"
"""The .npz member naming the ``ml_dtypes`` types of raw void members (see the module doc)."""


def save_npz(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray], *, compress: bool = False) -> None:
    """``numpy.savez`` of ``arrays`` plus the ``__dtypes__`` member that keeps their bfloat16 /
    float8 types (numpy stores those bytes as raw void)."""
    members = {name: np.asarray(a) for name, a in arrays.items()}
    if NPZ_DTYPES_MEMBER in members:
        raise ValueError(f"{NPZ_DTYPES_MEMBER!r} is reserved for the types of bfloat16/float8 arrays")
    types = {name: a.dtype.name for name, a in members.items() if dtypemod.is_extended(a.dtype)}
    for name in types:  # raw void: numpy cannot read back some of these types' own headers (<f1)
        a = members[name]
        members[name] = np.ascontiguousarray(a).view(np.dtype((np.void, a.dtype.itemsize)))
    if types:
        members[NPZ_DTYPES_MEMBER] = np.array(json.dumps(types, sort_keys=True))
    (np.savez_compressed if compress else np.savez)(path, **members)  # type: ignore[arg-type]


def _npz_types(archive: zipfile.ZipFile, label: str) -> dict[str, np.dtype]:
    """The ``__dtypes__`` member's mapping of member name -> extended dtype (empty if absent)."""
    member = NPZ_DTYPES_MEMBER + ".npy"
    if member not in archive.namelist():
        return {}
    where = f"{label}: member {member!r}"
    try:
        with archive.open(member) as f:
            value = np.lib.format.read_array(f, allow_pickle=False)
        if value.dtype.kind != "U" or value.shape != ():
            raise ValueError(f"expected a unicode scalar, not {value.shape} {value.dtype}")
        types = json.loads(str(value[()]), object_pairs_hook=_no_duplicate_pairs)
        if not isinstance(types, dict):
            raise ValueError("expected a JSON object of name -> dtype")
    except (*_NPZ_READ_ERRORS, _Problem, json.JSONDecodeError) as exc:
        raise ModelError(f"{where}: {_one_line(str(exc))}") from exc
    out = {}
    for name, text in types.items():
        dtype = dtypemod.by_name(text) if isinstance(text, str) else None
        if dtype is None:
            raise ModelError(f"{where}: array {name!r}: unknown type {text!r}; use one of {', '.join(dtypemod.EXTENDED)}")
        out[name] = dtype
    return out


def _npz_member_dtype(stored: np.dtype, name: str, types: Mapping[str, np.dtype]) -> np.dtype:
    """The variable dtype of a member whose header says ``stored``."""
    declared = types.get(name)
    if declared is None:
        if stored.kind == "V" and stored.fields is None and not dtypemod.is_extended(stored):
            raise _Problem(
                f"raw void dtype {stored.str!r} has no type: numpy stores bfloat16/float8 arrays "
                f"this way; name the type in a {NPZ_DTYPES_MEMBER!r} member "
                f"(collective.sources.save_npz writes it)"
            )
        return stored
    if stored.kind != "V" or stored.fields is not None or stored.itemsize != declared.itemsize:
        raise _Problem(f"{NPZ_DTYPES_MEMBER} says {declared.name} but the array is stored as {stored.str!r}")
    return declared


class NpzSource:
    """Arrays of a ``numpy.savez``/``savez_compressed`` archive; names are the archive keys.

    ``specs()`` reads only the .npy headers; ``fill()`` streams one array into ``out`` (no
    memory map, no pickles: object arrays are rejected).
    """

    def __init__(self, path: str | os.PathLike[str], *, label: str | None = None) -> None:
        self.path = Path(path)
        self.label = label if label is not None else os.fspath(path)
        self.description = self.label
        self._entries: dict[str, _NpzEntry] | None = None

    def _parsed(self) -> dict[str, _NpzEntry]:
        if self._entries is None:
            self._entries = self._read_headers()
        return self._entries

    def _read_headers(self) -> dict[str, _NpzEntry]:
        label = self.label
        try:
            archive = zipfile.ZipFile(self.path)
        except zipfile.BadZipFile as exc:
            raise ModelError(f"{label}: not a valid .npz archive (truncated or not a zip file)") from exc
        except (OSError, ValueError, EOFError) as exc:
            message = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ModelError(f"{label}: cannot read .npz archive: {message}") from exc
        entries: dict[str, _NpzEntry] = {}
        with archive:
            types = _npz_types(archive, label)
            for info in archive.infolist():
                member = info.filename
                if types and member == NPZ_DTYPES_MEMBER + ".npy":
                    continue
                if not member.endswith(".npy"):
                    raise ModelError(f"{label}: member {member!r} is not a .npy array")
                name = member[: -len(".npy")]
                where = f"{label}: array {name!r}"
                if not name:
                    raise ModelError(f"{label}: member {member!r}: empty variable name")
                if name in entries:
                    raise ModelError(f"{where}: duplicate name")
                try:
                    with archive.open(info) as f:
                        shape, fortran_order, dtype = _read_npy_header(f)
                except _NPZ_READ_ERRORS as exc:
                    raise ModelError(f"{where}: corrupt .npy header ({_one_line(str(exc))})") from exc
                try:
                    value_dtype = _npz_member_dtype(dtype, name, types)
                except _Problem as exc:
                    raise ModelError(f"{where}: {exc}") from exc
                problem = _dtype_problem(value_dtype)
                if problem:
                    raise ModelError(f"{where}: {problem}")
                spec = VariableSpec(name, tuple(int(d) for d in shape), dtypemod.wire(value_dtype))
                entries[name] = _NpzEntry(member, bool(fortran_order), spec, dtype.str)
            unknown = sorted(set(types) - set(entries))
            if unknown:
                raise ModelError(f"{label}: {NPZ_DTYPES_MEMBER} names arrays the archive lacks: {', '.join(unknown)}")
        if not entries:
            raise ModelError(f"{label}: the archive holds no arrays")
        return entries

    def specs(self) -> list[VariableSpec]:
        return [entry.spec for entry in self._parsed().values()]

    def fill(self, spec: VariableSpec, out: np.ndarray) -> None:
        entry = self._parsed().get(spec.name)
        if entry is None:
            raise ValueError(f"{self.label}: no array {spec.name!r}")
        _check_out(self.label, entry.spec, out)
        where = f"{self.label}: array {spec.name!r}"
        try:
            with zipfile.ZipFile(self.path) as archive, archive.open(entry.member) as f:
                shape, fortran_order, dtype = _read_npy_header(f)
                if tuple(shape) != entry.spec.shape or dtype.str != entry.stored:
                    raise ModelError(f"{where}: the file changed since it was loaded")
                if fortran_order and out.ndim > 1 and out.size:
                    _read_fortran_order(f, out)
                else:
                    _read_c_order(f, out)
                f.read(1)  # reach the end of the member so zipfile verifies its CRC
        except _NPZ_READ_ERRORS as exc:
            raise ModelError(f"{where}: cannot read ({_one_line(str(exc))})") from exc


_SAFETENSORS_DTYPES: dict[str, str] = {
    "BOOL": "|b1",
    "U8": "|u1",
    "I8": "|i1",
    "U16": "<u2",
    "I16": "<i2",
    "F16": "<f2",
    "U32": "<u4",
    "I32": "<i4",
    "F32": "<f4",
    "U64": "<u8",
    "I64": "<i8",
    "F64": "<f8",
    "C64": "<c8",
    **dtypemod.SAFETENSORS_CODES,
}


@dataclass(frozen=True)
class _TensorEntry:
    start: int  # absolute file offset
    spec: VariableSpec


class SafetensorsSource:
    """Tensors of a ``.safetensors`` file; names are kept exactly (dots and slashes included).

    ``specs()`` parses and validates the JSON header; ``fill()`` reads one tensor's bytes
    straight into ``out``. ``__metadata__`` is ignored.
    """

    def __init__(self, path: str | os.PathLike[str], *, label: str | None = None) -> None:
        self.path = Path(path)
        self.label = label if label is not None else os.fspath(path)
        self.description = self.label
        self._entries: dict[str, _TensorEntry] | None = None

    def _parsed(self) -> dict[str, _TensorEntry]:
        if self._entries is None:
            self._entries = self._read_header()
        return self._entries

    def _read_header(self) -> dict[str, _TensorEntry]:
        label = self.label
        try:
            with open(self.path, "rb") as f:
                file_size = os.fstat(f.fileno()).st_size
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise ModelError(
                        f"{label}: not a safetensors file: {file_size} bytes is too short for a header"
                    )
                header_len = int.from_bytes(prefix, "little")
                if header_len > _SAFETENSORS_MAX_HEADER:
                    raise ModelError(
                        f"{label}: not a safetensors file: header length {header_len} exceeds "
                        f"the {_SAFETENSORS_MAX_HEADER}-byte limit"
                    )
                if 8 + header_len > file_size:
                    raise ModelError(
                        f"{label}: corrupt safetensors header: header length {header_len} exceeds "
                        f"the file size {file_size} (truncated?)"
                    )
                raw = f.read(header_len)
        except OSError as exc:
            raise ModelError(f"{label}: cannot read: {exc.strerror or exc}") from exc
        try:
            text = raw.decode("utf-8")
            if not text.startswith("{"):
                raise _Problem("header is not a JSON object")
            header = json.loads(text, object_pairs_hook=_no_duplicate_pairs)
        except (UnicodeDecodeError, json.JSONDecodeError, _Problem, RecursionError) as exc:
            raise ModelError(f"{label}: corrupt safetensors header ({_one_line(str(exc))})") from exc
        if not isinstance(header, dict):
            raise ModelError(f"{label}: corrupt safetensors header (not a JSON object)")

        base = 8 + header_len
        data_size = file_size - base
        entries: dict[str, _TensorEntry] = {}
        spans: list[tuple[int, int, str]] = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            where = f"{label}: tensor {name!r}"
            if not name:
                raise ModelError(f"{label}: empty tensor name")
            try:
                spec, begin, end = self._parse_tensor(name, info)
            except _Problem as exc:
                raise ModelError(f"{where}: {exc}") from exc
            if end > data_size:
                raise ModelError(
                    f"{where}: data_offsets end at {end} but the file holds {data_size} data bytes "
                    f"(truncated?)"
                )
            entries[name] = _TensorEntry(base + begin, spec)
            spans.append((begin, end, name))
        if not entries:
            raise ModelError(f"{label}: the file holds no tensors")
        # As the safetensors library: the data buffer is covered exactly, without overlaps or holes.
        expected = 0
        for begin, end, name in sorted(spans):
            if begin != expected:
                raise ModelError(
                    f"{label}: tensor {name!r}: data_offsets start at {begin}, expected {expected} "
                    f"(overlapping tensors or a hole)"
                )
            expected = end
        if expected != data_size:
            raise ModelError(
                f"{label}: corrupt safetensors file: tensors cover {expected} data bytes but the "
                f"file holds {data_size}"
            )
        return entries

    @staticmethod
    def _parse_tensor(name: str, info: object) -> tuple[VariableSpec, int, int]:
        if not isinstance(info, dict):
            raise _Problem(f"expected a mapping with dtype, shape and data_offsets, not {info!r}")
        code = info.get("dtype")
        if not isinstance(code, str):
            raise _Problem(f"missing or invalid dtype {code!r}")
        if code not in _SAFETENSORS_DTYPES:
            raise _Problem(f"dtype {code!r} is not supported; use one of {', '.join(_SAFETENSORS_DTYPES)}")
        if "shape" not in info:
            raise _Problem("missing shape")
        shape = _parse_shape(info["shape"])
        offsets = info.get("data_offsets")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise _Problem(f"invalid data_offsets {offsets!r}")
        begin, end = offsets
        dtype = dtypemod.from_wire(_SAFETENSORS_DTYPES[code])
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise _Problem(
                f"data_offsets {offsets!r} span {end - begin} bytes but shape {list(shape)} {code} "
                f"needs {nbytes}"
            )
        return VariableSpec(name, shape, dtypemod.wire(dtype)), begin, end

    def specs(self) -> list[VariableSpec]:
        return [entry.spec for entry in self._parsed().values()]

    def fill(self, spec: VariableSpec, out: np.ndarray) -> None:
        entry = self._parsed().get(spec.name)
        if entry is None:
            raise ValueError(f"{self.label}: no tensor {spec.name!r}")
        _check_out(self.label, entry.spec, out)
        try:
            with open(self.path, "rb", buffering=0) as f:
                f.seek(entry.start)
                _read_c_order(f, out)
        except (OSError, EOFError) as exc:
            message = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ModelError(f"{self.label}: tensor {spec.name!r}: cannot read ({message})") from exc
