"""``.safetensors`` files: the header is checked, the values are read in bounded blocks."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np

from collective import dtypes as dtypemod
from collective.errors import ModelError
from collective.model import VariableSpec, quoted
from collective.outfile import OutputFile, written
from collective.sources._common import (
    _SAFETENSORS_MAX_HEADER,
    SAFETENSORS_SUFFIX,
    StoredSource,
    _is_int,
    _json_loads,
    _one_line,
    _parse_shape,
    _Problem,
    _read_c_order,
    not_regular,
    written_name_problem,
)
from collective.sources.mapped import DataFile

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


def save_safetensors(path: str | os.PathLike[str] | OutputFile, arrays: dict[str, np.ndarray],
                     metadata: dict[str, str] | None = None) -> None:
    """Write ``arrays`` (name -> array, in order) as a ``.safetensors`` file, with ``metadata``
    (str -> str) as its ``__metadata__``: what this module and the ``safetensors`` package read
    back, bfloat16 / float8 included. Written safely (``collective.outfile``: a new file beside
    ``path``, renamed onto it; never through a link; nothing left if it fails). A name longer
    than ``limits.MAX_NAME_CHARS`` is refused (ModelError) before anything is written."""
    what = path.what if isinstance(path, OutputFile) else str(path)
    codes = {wire: code for code, wire in _SAFETENSORS_DTYPES.items()}
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    pos = 0
    for name, a in arrays.items():
        problem = written_name_problem(name)
        if problem:
            raise ModelError(f"{what}: tensor {quoted(name)}: {problem}")
        code = codes.get(dtypemod.wire(a.dtype))
        if code is None:
            raise ModelError(f"{what}: tensor {quoted(name)}: dtype {a.dtype} has no safetensors code; write .npz instead")
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [pos, pos + a.nbytes]}
        pos += a.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    if len(head) > _SAFETENSORS_MAX_HEADER:
        raise ModelError(f"{what}: the header would take {len(head):,} bytes; readers refuse more than "
                         f"{_SAFETENSORS_MAX_HEADER:,}")
    with written(path) as fh:
        fh.write(len(head).to_bytes(8, "little"))
        fh.write(head)
        for a in arrays.values():
            fh.write(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))


@dataclass(frozen=True)
class _TensorEntry:
    start: int  # absolute file offset
    spec: VariableSpec


class SafetensorsSource(StoredSource):
    """Tensors of a ``.safetensors`` file; names are kept exactly (dots and slashes included).

    ``specs()`` parses and validates the JSON header; ``fill()`` reads one tensor's bytes
    straight into ``out``. ``__metadata__`` is ignored.
    """

    what = "tensor"

    def _read(self) -> dict[str, _TensorEntry]:
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
            header = _json_loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError, _Problem, RecursionError) as exc:
            raise ModelError(f"{label}: corrupt safetensors header ({_one_line(str(exc))})") from exc
        if not isinstance(header, dict):
            raise ModelError(f"{label}: corrupt safetensors header (not a JSON object)")

        base = self._data_start = 8 + header_len
        data_size = file_size - base
        entries: dict[str, _TensorEntry] = {}
        spans: list[tuple[int, int, str]] = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            where = f"{label}: tensor {quoted(name)}"
            if not name:
                raise ModelError(f"{label}: empty tensor name")
            try:
                spec, begin, end = self._parse_tensor(name, info)
            except _Problem as exc:
                raise ModelError(f"{where}: {exc}") from exc
            if end > data_size:
                raise ModelError(
                    f"{where}: data_offsets end at {quoted(end)} but the file holds {data_size} data bytes "
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
                    f"{label}: tensor {quoted(name)}: data_offsets start at {quoted(begin)}, expected {expected} "
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
            raise _Problem(f"expected a mapping with dtype, shape and data_offsets, not {quoted(info)}")
        code = info.get("dtype")
        if not isinstance(code, str):
            raise _Problem(f"missing or invalid dtype {quoted(code)}")
        if code not in _SAFETENSORS_DTYPES:
            raise _Problem(f"dtype {quoted(code)} is not supported; use one of {', '.join(_SAFETENSORS_DTYPES)}")
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
            raise _Problem(f"invalid data_offsets {quoted(offsets)}")
        begin, end = offsets
        dtype = dtypemod.from_wire(_SAFETENSORS_DTYPES[code])
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise _Problem(
                f"data_offsets {quoted(offsets)} span {quoted(end - begin)} bytes but shape {quoted(list(shape))} {code} "
                f"needs {quoted(nbytes)}"
            )
        return VariableSpec(name, shape, dtypemod.wire(dtype)), begin, end

    def data_files(self) -> tuple[list[DataFile], list[tuple[VariableSpec, int, int]]]:
        """The file holding the values, and every tensor in the file's order as (spec, 0, its
        offset in the file): what serving straight from the file needs (``sources/mapped.py``)."""
        entries = sorted(self._parsed().values(), key=lambda e: e.start)
        return [DataFile(self.path, self.label, self._data_start)], [(e.spec, 0, e.start) for e in entries]

    def _fill(self, entry: _TensorEntry, spec: VariableSpec, out: np.ndarray) -> None:
        try:
            with open(self.path, "rb", buffering=0) as f:
                f.seek(entry.start)
                _read_c_order(f, out)
        except (OSError, EOFError) as exc:
            message = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ModelError(f"{self.label}: tensor {quoted(spec.name)}: cannot read ({message})") from exc


INDEX_SUFFIX = ".safetensors.index.json"
"""A sharded Hugging Face checkpoint's index: ``model.safetensors.index.json``."""


@dataclass(frozen=True)
class _ShardEntry:
    shard: SafetensorsSource
    spec: VariableSpec


class ShardedSafetensorsSource(StoredSource):
    """A sharded Hugging Face checkpoint: the index's ``weight_map`` (tensor name -> shard file
    beside the index) in its order, each tensor read from its shard.

    The index and every shard are checked when loaded: a shard outside the index's directory (also
    one a symbolic link leads out of it), a missing shard file or one that is no regular file, a
    tensor the index lists that its shard does not hold (or one a shard holds that the index does
    not list), a name listed twice: one ModelError naming the file.
    """

    what = "tensor"

    def __init__(self, path: str | os.PathLike[str], *, label: str | None = None) -> None:
        super().__init__(path, label=label)
        self.shards: list[SafetensorsSource] = []  # in the order the index first names them

    def _read(self) -> dict[str, _ShardEntry]:
        label = self.label
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelError(f"{label}: cannot read the index: {getattr(exc, 'strerror', None) or exc}") from exc
        try:
            index = _json_loads(text)
        except (json.JSONDecodeError, _Problem, RecursionError) as exc:
            raise ModelError(f"{label}: corrupt index ({_one_line(str(exc))}); every tensor name "
                             f"must appear once in weight_map") from exc
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelError(f"{label}: not a safetensors index: it needs a non-empty \"weight_map\" "
                             f"object (tensor name -> shard file)")
        label_dir = os.path.dirname(label)
        # Where a shard may resolve to: the index's directory, or the directory of the file the
        # index links to (a Hugging Face cache links both the index and its shards into blobs/).
        roots = {os.path.realpath(self.path.parent), os.path.dirname(os.path.realpath(self.path))}
        shards: dict[str, SafetensorsSource] = {}
        wanted: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            if not isinstance(fname, str) or not fname or not fname.lower().endswith(SAFETENSORS_SUFFIX):
                raise ModelError(f"{label}: tensor {quoted(name)}: shard {quoted(fname)} is not a .safetensors file name")
            norm = os.path.normpath(fname)
            if os.path.isabs(norm) or norm == ".." or norm.startswith(".." + os.sep):
                raise ModelError(f"{label}: tensor {quoted(name)}: shard {quoted(fname)} is outside the index's "
                                 f"directory; shards must lie beside the index")
            if norm not in shards:
                shard_path, shard_label = self.path.parent / norm, os.path.join(label_dir, norm)
                if not shard_path.exists():
                    raise ModelError(
                        f"{shard_label}: missing shard ({sum(1 for v in weight_map.values() if v == fname)} "
                        f"tensor(s) of {label}, first {quoted(name)}); download every shard beside the index"
                    )
                problem = not_regular(shard_path)
                if problem:
                    raise ModelError(f"{shard_label}: shard of {label} {problem}")
                real = os.path.realpath(shard_path)
                if not any(os.path.commonpath((real, root)) == root for root in roots):
                    raise ModelError(
                        f"{shard_label}: shard of {label} resolves to {real}, outside the index's directory "
                        f"(through a symbolic link); shards must lie beside the index: copy the file there"
                    )
                shards[norm] = SafetensorsSource(real, label=shard_label)  # opened by the checked path
                wanted[norm] = []
            wanted[norm].append(name)
        entries: dict[str, _ShardEntry] = {}
        held = {norm: {spec.name: spec for spec in shard.specs()} for norm, shard in shards.items()}  # checks each
        for norm, shard in shards.items():
            for name in wanted[norm]:
                spec = held[norm].pop(name, None)
                if spec is None:
                    raise ModelError(
                        f"{shard.label}: does not hold tensor {quoted(name)}, which {label} puts there; "
                        f"the index and its shards do not match (download them again)"
                    )
                entries[name] = _ShardEntry(shard, spec)
        for norm, shard in shards.items():
            if held[norm]:
                extra = next(iter(held[norm]))
                raise ModelError(
                    f"{shard.label}: holds {len(held[norm])} tensor(s) {label} does not list for it "
                    f"(first {quoted(extra)}); the index and its shards do not match (download them again)"
                )
        self.shards = list(shards.values())
        return {name: entries[name] for name in weight_map}

    def data_files(self) -> tuple[list[DataFile], list[tuple[VariableSpec, int, int]]]:
        """Every shard, in the index's order, and every tensor as (spec, shard index, offset in
        the shard), shard by shard in each shard's order."""
        self._parsed()
        files, tensors = [], []
        for i, shard in enumerate(self.shards):
            (file,), held = shard.data_files()
            files.append(file)
            tensors += [(spec, i, offset) for spec, _, offset in held]
        return files, tensors

    def _fill(self, entry: _ShardEntry, spec: VariableSpec, out: np.ndarray) -> None:
        entry.shard.fill(spec, out)
