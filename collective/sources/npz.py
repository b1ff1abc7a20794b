"""``.npz`` archives (``numpy.savez``, or ``save_npz`` for bfloat16 / float8 members)."""

from __future__ import annotations

import json
import os
import re
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from collective import dtypes as dtypemod
from collective.errors import ModelError
from collective.model import VariableSpec, quoted
from collective.outfile import OutputFile, written
from collective.sources._common import (
    StoredSource,
    _dtype_problem,
    _json_loads,
    _one_line,
    _Problem,
    _read_c_order,
    _read_fortran_order,
    written_name_problem,
)

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


def save_npz(path: str | os.PathLike[str] | OutputFile, arrays: Mapping[str, np.ndarray], *,
             compress: bool = False) -> None:
    """``arrays`` as an ``.npz`` archive (what ``numpy.load`` reads), plus the ``__dtypes__``
    member that keeps their bfloat16 / float8 types (numpy stores those bytes as raw void).

    Written safely (``collective.outfile``: a new file beside ``path``, renamed onto it; never
    through a link; nothing left if it fails). A name that is not a safe member name (absolute,
    with a ``..`` component, a backslash, a drive letter or a control character: unzipping the
    archive would write outside its directory) or longer than ``limits.MAX_NAME_CHARS`` is
    refused (ModelError) before anything is written: names are never changed."""
    members = {name: np.asarray(a) for name, a in arrays.items()}
    what = path.what if isinstance(path, OutputFile) else str(path)
    if NPZ_DTYPES_MEMBER in members:
        raise ModelError(f"{what}: {NPZ_DTYPES_MEMBER!r} is reserved for the types of bfloat16/float8 arrays")
    for name in members:
        problem = _member_problem(name)
        if problem:
            raise ModelError(f"{what}: tensor {quoted(name)}: {problem}; write a .safetensors file, "
                             f"which keeps any name")
    types = {name: a.dtype.name for name, a in members.items() if dtypemod.is_extended(a.dtype)}
    for name in types:  # raw void: numpy cannot read back some of these types' own headers (<f1)
        a = members[name]
        members[name] = np.ascontiguousarray(a).view(np.dtype((np.void, a.dtype.itemsize)))
    if types:
        members[NPZ_DTYPES_MEMBER] = np.array(json.dumps(types, sort_keys=True))
    # As numpy.savez does, without its keyword arguments (a tensor named "file" is a member too)
    # and never a pickle.
    compression = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with written(path) as fh, zipfile.ZipFile(fh, mode="w", compression=compression, allowZip64=True) as archive:
        for name, a in members.items():
            with archive.open(name + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, a, allow_pickle=False)


_DRIVE = re.compile(r"^[A-Za-z]:")


def _member_problem(name: str) -> str | None:
    """Why ``name`` is no safe .npz member name, or None."""
    problem = written_name_problem(name)
    if problem:
        return problem
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "its name holds a control character"
    if name.startswith("/") or "\\" in name or _DRIVE.match(name) or ".." in name.split("/"):
        return ("its name is no safe archive member name (absolute, a '..' component, a backslash or a drive): "
                "unzipping the archive would write outside its directory")
    return None


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
        types = _json_loads(str(value[()]))
        if not isinstance(types, dict):
            raise ValueError("expected a JSON object of name -> dtype")
    except (*_NPZ_READ_ERRORS, _Problem, json.JSONDecodeError) as exc:
        raise ModelError(f"{where}: {_one_line(str(exc))}") from exc
    out = {}
    for name, text in types.items():
        dtype = dtypemod.by_name(text) if isinstance(text, str) else None
        if dtype is None:
            raise ModelError(f"{where}: array {quoted(name)}: unknown type {quoted(text)}; use one of {', '.join(dtypemod.EXTENDED)}")
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


class NpzSource(StoredSource):
    """Arrays of a ``numpy.savez``/``savez_compressed`` archive; names are the archive keys.

    ``specs()`` reads only the .npy headers; ``fill()`` streams one array into ``out`` (no
    memory map, no pickles: object arrays are rejected).
    """

    def _read(self) -> dict[str, _NpzEntry]:
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
                    raise ModelError(f"{label}: member {quoted(member)} is not a .npy array")
                name = member[: -len(".npy")]
                where = f"{label}: array {quoted(name)}"
                if not name:
                    raise ModelError(f"{label}: member {quoted(member)}: empty variable name")
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

    def _fill(self, entry: _NpzEntry, spec: VariableSpec, out: np.ndarray) -> None:
        where = f"{self.label}: array {quoted(spec.name)}"
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
