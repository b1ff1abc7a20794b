"""Helpers every model source shares: checks of names, shapes, seeds and dtypes; exact reads."""

from __future__ import annotations

import json
import math
import numbers
import os
import stat
import warnings
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from collective import dtypes as dtypemod
from collective.errors import ModelError
from collective.limits import MAX_NAME_CHARS
from collective.model import MAX_NDIM, VariableSpec, quoted, shape_problem

SPEC_SUFFIXES = (".yaml", ".yml", ".json")
NPZ_SUFFIX = ".npz"
SAFETENSORS_SUFFIX = ".safetensors"

RANDOM_BLOCK_ELEMENTS = 1 << 20
"""Random values are generated this many elements at a time (part of the determinism contract)."""

_IO_CHUNK_BYTES = 1 << 20
_SAFETENSORS_MAX_HEADER = 100_000_000  # the limit the safetensors library enforces

_KINDS_HINT = dtypemod.KINDS_HINT
_dtype_problem = dtypemod.problem


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
        raise ModelError(f"{where} must be a non-negative integer, not {quoted(value)}")
    return int(value)  # type: ignore[call-overload]


def _parse_dtype(value: object) -> np.dtype:
    if not isinstance(value, str) or not value.strip():
        raise _Problem(f"dtype must be a numpy dtype name such as 'float32', not {quoted(value)}")
    extended = dtypemod.by_name(value.strip())
    if extended is not None:
        return extended
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # deprecated aliases count as unknown
            dtype = np.dtype(value.strip())
    except (TypeError, ValueError, Warning) as exc:
        if dtypemod.is_ml_dtypes_name(value.strip()):  # numpy knows it only once ml_dtypes is imported
            raise _Problem(f"unsupported dtype {quoted(value.strip())}; {_KINDS_HINT}") from exc
        raise _Problem(f"unknown dtype {quoted(value)}; {_KINDS_HINT}") from exc
    problem = _dtype_problem(dtype)
    if problem:
        raise _Problem(problem)
    return dtype


def _parse_shape(value: object) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise _Problem(f"shape must be a list of non-negative integers ([] for a scalar), not {quoted(value)}")
    if len(value) > MAX_NDIM:  # by its length alone: a YAML list of aliases can be millions long
        raise _Problem(shape_problem(value) or "")
    for dim in value:
        if not _is_int(dim) or int(dim) < 0:
            raise _Problem(f"shape {quoted(list(value))}: dimension {quoted(dim)} is not a non-negative integer")
    shape = tuple(int(d) for d in value)
    problem = shape_problem(shape)
    if problem:
        raise _Problem(problem)
    return shape


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise _Problem(f"name must be a non-empty string, not {quoted(name)}")
    if not name:
        raise _Problem("empty variable name")
    return name


def written_name_problem(name: str) -> str | None:
    """Why a tensor named ``name`` cannot be written to a model file (``save_npz``,
    ``save_safetensors``), or None. The names may come from a peer (``collective fetch``)."""
    if len(name) > MAX_NAME_CHARS:
        return f"its name has {len(name):,} characters; the limit is {MAX_NAME_CHARS:,}"
    return None


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
            raise _Problem(f"duplicate key {quoted(key)}")
        result[key] = value
    return result


MAX_INT_DIGITS = 4300
"""Python's own limit on reading an integer from text; no shape, offset or seed comes near it."""


def long_integer(text: str) -> str | None:
    """Why the integer written ``text`` is refused unread: more than ``MAX_INT_DIGITS``
    characters (int() raises ValueError past 4,300 decimal digits, a traceback to the user, and
    reads hexadecimal ones into integers no message can format); else None."""
    if len(text) <= MAX_INT_DIGITS:
        return None
    return f"integer {text[:12]}... has {len(text)} characters, more than the {MAX_INT_DIGITS} a number here may have"


def _json_int(text: str) -> int:
    problem = long_integer(text)
    if problem:
        raise _Problem(problem)
    return int(text)


def _json_loads(text: str) -> Any:
    """``json.loads`` that refuses a duplicate key and an integer past ``MAX_INT_DIGITS`` with
    ``_Problem``; invalid JSON raises JSONDecodeError, nesting past the stack RecursionError."""
    return json.loads(text, object_pairs_hook=_no_duplicate_pairs, parse_int=_json_int)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def not_regular(path: Path) -> str | None:
    """Why ``path`` (symbolic links followed) is no model file: "is a FIFO (named pipe)", a
    device, a socket, a directory, "cannot be read: ..."; None for a regular file. Checked
    before a file is opened: opening a FIFO for reading waits for a writer for ever, and a
    device such as /dev/zero never ends."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    if stat.S_ISREG(mode):
        return None
    kind = next((what for test, what in _NOT_REGULAR if test(mode)), None)
    return f"is {kind}, not a regular file" if kind else "is not a regular file"


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


class StoredSource:
    """A model file whose values are stored (.npz, .safetensors): its index is read once, on
    first use (``_read()``: variable name -> entry with a ``spec``), and ``fill`` finds the
    entry and checks ``out`` before the subclass reads the values (``_fill(entry, spec, out)``)."""

    what = "array"  # what the file calls a variable, for messages

    def __init__(self, path: str | os.PathLike[str], *, label: str | None = None) -> None:
        self.path = Path(path)
        self.label = label if label is not None else os.fspath(path)
        self.description = self.label
        self._entries: dict | None = None

    def _parsed(self) -> dict:
        if self._entries is None:
            self._entries = self._read()
        return self._entries

    def _read(self) -> dict:
        raise NotImplementedError

    def specs(self) -> list[VariableSpec]:
        return [entry.spec for entry in self._parsed().values()]

    def fill(self, spec: VariableSpec, out: np.ndarray) -> None:
        entry = self._parsed().get(spec.name)
        if entry is None:
            raise ValueError(f"{self.label}: no {self.what} {spec.name!r}")
        _check_out(self.label, entry.spec, out)
        self._fill(entry, spec, out)

    def _fill(self, entry, spec: VariableSpec, out: np.ndarray) -> None:
        raise NotImplementedError
