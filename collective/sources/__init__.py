"""Model sources: where the chief's initial variable values come from.

``load_source(ref)`` turns what the user typed into a ``ModelSource``:

* a preset name: ``mlp`` (small demo model) or ``transformer-100m`` (alias ``transformer``);
* a variable spec in YAML (``.yaml``/``.yml``) or JSON (``.json``), whose values are produced by
  seeded initializers;
* a ``.npz`` archive (``numpy.savez``) or a ``.safetensors`` file, whose arrays are the values;
* a sharded Hugging Face checkpoint: its ``model.safetensors.index.json`` (any name ending in
  ``.safetensors.index.json``) with the shards beside it, or a directory holding such an index
  (or a single ``model.safetensors``).

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

import os
from pathlib import Path

from collective.errors import ModelError
from collective.model import ModelSource, validate_model
from collective.sources._common import (
    NPZ_SUFFIX,
    RANDOM_BLOCK_ELEMENTS,
    SAFETENSORS_SUFFIX,
    SPEC_SUFFIXES,
    _check_seed,
    not_regular,
)
from collective.sources.npz import NPZ_DTYPES_MEMBER, NpzSource, save_npz
from collective.sources.safetensors import (
    INDEX_SUFFIX,
    SafetensorsSource,
    ShardedSafetensorsSource,
    save_safetensors,
)
from collective.sources.specs import (
    INITIALIZERS,
    PRESET_ALIASES,
    PRESETS,
    Initializer,
    SpecFileSource,
    SpecSource,
    _preset_source,
    _unknown_model_message,
    keras_fans,
    preset_document,
    variable_rng,
)

__all__ = [
    "Initializer",
    "keras_fans",
    "INITIALIZERS",
    "PRESETS",
    "PRESET_ALIASES",
    "RANDOM_BLOCK_ELEMENTS",
    "NpzSource",
    "SafetensorsSource",
    "ShardedSafetensorsSource",
    "SpecFileSource",
    "SpecSource",
    "load_source",
    "preset_document",
    "preset_names",
    "save_npz",
    "save_safetensors",
    "variable_rng",
    "NPZ_DTYPES_MEMBER",
]


def preset_names() -> tuple[str, ...]:
    """The canonical preset names (aliases such as ``transformer`` are not listed)."""
    return PRESETS




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


def takes_seed(ref: str | os.PathLike[str]) -> bool:
    """Whether a seed changes what ``ref`` loads (``_open``'s reading of it): a preset or a
    .yaml/.json spec draws its values; a stored file (.npz, .safetensors, an index, a checkpoint
    directory) holds them, so a seed does nothing there."""
    ref = os.fspath(ref)
    key = ref.strip().lower()
    if PRESET_ALIASES.get(key, key) in PRESETS:
        return True
    path = Path(ref).expanduser()
    return not path.is_dir() and not path.name.lower().endswith(INDEX_SUFFIX) and path.suffix.lower() in SPEC_SUFFIXES


def _open(ref: str, seed: int | None) -> ModelSource:
    key = ref.strip().lower()
    preset = PRESET_ALIASES.get(key, key)
    if preset in PRESETS:
        return _preset_source(preset, seed)
    path = Path(ref).expanduser()
    if not path.exists():
        raise ModelError(_unknown_model_message(ref))
    if path.is_dir():
        path, ref = _in_directory(path, ref)
    problem = not_regular(path)  # before anything opens it: a FIFO would block the read for ever
    if problem:
        raise ModelError(f"model {ref!r}: {problem}; use a .yaml/.json spec, .npz or .safetensors file, "
                         f"or a checkpoint directory")
    if path.name.lower().endswith(INDEX_SUFFIX):
        return ShardedSafetensorsSource(path, label=ref)
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


def _in_directory(path: Path, ref: str) -> tuple[Path, str]:
    """A checkpoint directory's model file: its one ``*.safetensors.index.json`` (sharded), else
    its ``model.safetensors``."""
    indexes = sorted(p.name for p in path.iterdir() if p.name.lower().endswith(INDEX_SUFFIX))
    if len(indexes) > 1:
        raise ModelError(f"model {ref!r}: the directory holds {len(indexes)} indexes ({', '.join(indexes)}); "
                         f"name the one to serve")
    name = indexes[0] if indexes else "model.safetensors" if (path / "model.safetensors").is_file() else None
    if name is None:
        raise ModelError(
            f"model {ref!r}: is a directory without a *{INDEX_SUFFIX} or model.safetensors; use a "
            f"checkpoint directory, a .yaml/.json spec, .npz or .safetensors file"
        )
    return path / name, os.path.join(ref, name)
