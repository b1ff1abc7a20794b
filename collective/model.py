"""Variable specifications and the enums of TensorFlow's variable semantics.

A ``VariableSpec`` is what both sides agree on before any bytes move: name, shape, dtype and
the synchronization/aggregation modes. Values are never part of a spec; a model *source*
(``collective.sources``) fills them into buffers the caller provides, so the chief can
materialise a model straight into its send arena without an extra copy.
"""

from __future__ import annotations

import enum
import itertools
import math
import numbers
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from collective import dtypes
from collective.errors import InvalidVariableError, ModelError
from collective.logs import quoted_text
from collective.sizes import format_bytes

_QUOTED_CHARS = 80
_QUOTED_ITEMS = 8
_QUOTED_BITS = 256  # ints up to 78 digits are shown whole


def quoted(value: object, *, _nested: bool = False) -> str:
    """``value`` as an error message quotes a rejected value: a scalar's repr (a string cut to a
    short prefix, an integer past 78 digits by its length), a list or mapping by its first few
    items, a list or mapping inside one as ``[...]`` / ``{...}``.

    Formatting never costs more than a bounded part of ``value``: a YAML alias bomb is a few
    hundred bytes whose nested lists expand to gigabytes when formatted whole (``!r``), and an
    integer past Python's 4,300-digit limit cannot be formatted at all (ValueError)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, numbers.Integral):
        number = int(value)  # type: ignore[call-overload]
        if number.bit_length() <= _QUOTED_BITS:
            return str(number)
        digits = int(math.log10(abs(number))) + 1
        if abs(number) < 10 ** (digits - 1):  # log10 rounded up across a power of ten
            digits -= 1
        return f"<an integer of {digits} digits>"
    if isinstance(value, str | bytes):
        return quoted_text(value, _QUOTED_CHARS)
    if isinstance(value, dict):
        if _nested:
            return "{...}"
        items = [f"{quoted(k, _nested=True)}: {quoted(v, _nested=True)}"
                 for k, v in itertools.islice(value.items(), _QUOTED_ITEMS)]
        return "{" + ", ".join(items) + (", ..." if len(value) > _QUOTED_ITEMS else "") + "}"
    if isinstance(value, list | tuple | set | frozenset):
        if _nested:
            return "[...]"
        items = [quoted(v, _nested=True) for v in itertools.islice(value, _QUOTED_ITEMS)]
        return "[" + ", ".join(items) + (", ..." if len(value) > _QUOTED_ITEMS else "") + "]"
    text = repr(value)  # a float, a date: short; anything else is cut
    return text if len(text) <= _QUOTED_CHARS else text[:_QUOTED_CHARS] + "..."


class _ParsedEnum(enum.Enum):
    @classmethod
    def parse(cls, value: object, *, variable: str | None = None) -> _ParsedEnum:
        """Accept a member, or its name in any case (``"on_write"``); raise ValueError otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().upper()
            if key in cls.__members__:
                return cls.__members__[key]
        where = f" of variable {variable!r}" if variable else ""
        allowed = ", ".join(m.name for m in cls)
        raise ValueError(f"unknown {cls.__name__.lower()} {quoted(value)}{where}; use one of {allowed}")


class Synchronization(_ParsedEnum):
    """When replicas are made consistent (TensorFlow's ``tf.VariableSynchronization``)."""

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class Aggregation(_ParsedEnum):
    """How per-replica updates combine (TensorFlow's ``tf.VariableAggregation``)."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


@dataclass(frozen=True)
class VariableSpec:
    """Everything about a variable except its value.

    ``dtype`` is numpy's ``dtype.str`` (for example ``"<f4"``), so byte order is explicit, or
    the name of an ``ml_dtypes`` type (``"bfloat16"``, ``"float8_e4m3fn"``; see collective.dtypes).
    ``trainable=None`` means the default: True unless the variable is sync-on-read.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    synchronization: Synchronization = Synchronization.AUTO
    aggregation: Aggregation = Aggregation.NONE
    trainable: bool | None = None

    @property
    def np_dtype(self) -> np.dtype:
        return dtypes.from_wire(self.dtype)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.size * self.np_dtype.itemsize

    def describe(self) -> str:
        """``(3, 4) float32`` style, for difference listings and logs."""
        return f"{tuple(self.shape)} {self.np_dtype.name}{'' if self.np_dtype.isnative else ' ' + self.dtype}"


class ModelSource(Protocol):
    """Where initial values come from. Implementations live in ``collective.sources``."""

    description: str

    def specs(self) -> list[VariableSpec]:
        """The model's variables, in model order. Raises ModelError for invalid input."""
        ...

    def fill(self, spec: VariableSpec, out: np.ndarray) -> None:
        """Write the initial value of ``spec`` into ``out`` (its shape and dtype).

        Raises ModelError naming the file and entry when the value cannot be produced.
        """
        ...


# --------------------------------------------------------------------------------------------
# Rules every model obeys, whatever it came from (a file, a worker's declaration)
# --------------------------------------------------------------------------------------------

MAX_NDIM = 32
"""numpy 1's limit on dimensions, so any numpy on any worker can hold every variable."""

MAX_BYTES = (1 << 63) - 1
"""Largest dimension and largest variable: the wire carries them as int64 / uint64."""

_REPLICA_SUFFIX = re.compile(r"(.+)/replica_([1-9][0-9]*)", re.DOTALL)


def _shape_text(spec: VariableSpec) -> str:
    return f"[{', '.join(quoted(d) for d in spec.shape)}]"


def _dtype_name(text: str) -> str:
    try:
        return dtypes.from_wire(text).name
    except (TypeError, ValueError, SyntaxError):
        return text


def shape_problem(shape: Sequence[int]) -> str | None:
    """Why ``shape`` (non-negative integers) cannot be a variable's: more than ``MAX_NDIM``
    dimensions, or a dimension past int64; checked before anything multiplies the dimensions (a
    product of thousands of huge integers takes hours)."""
    if len(shape) > MAX_NDIM:
        return f"{len(shape)} dimensions; at most {MAX_NDIM} are supported"
    for d in shape:
        if not 0 <= d <= MAX_BYTES:
            return (
                f"shape [{', '.join(quoted(d) for d in shape)}] has dimension {quoted(d)}; dimensions must "
                f"be between 0 and 2**63-1"
            )
    return None


def spec_problem(spec: VariableSpec) -> str | None:
    """Why ``spec`` cannot be a variable on the wire (name, shape, size), or None.

    The name must be UTF-8 text (a JSON ``"\\ud800"`` escape is not); every dimension and the
    byte size must fit int64; at most ``MAX_NDIM`` dimensions; the dtype must be one numpy knows.
    """
    name = spec.name
    if not isinstance(name, str) or not name:
        return f"variable {quoted(name)}: the name must be a non-empty string"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"variable {quoted(name)}: the name is not valid Unicode text (a lone surrogate "
            f"{name[exc.start]!r} at character {exc.start}); rename it"
        )
    try:
        itemsize = dtypes.from_wire(spec.dtype).itemsize
    except (TypeError, ValueError, SyntaxError):
        return f"variable {quoted(name)}: dtype {quoted(spec.dtype)} is not a numpy dtype"
    shape = tuple(spec.shape)
    problem = shape_problem(shape)
    if problem:
        return f"variable {quoted(name)}: {problem}"
    nbytes = 1
    for d in shape:
        nbytes *= d
    nbytes *= itemsize
    if nbytes > MAX_BYTES:
        return (
            f"variable {quoted(name)} is {_shape_text(spec)} {_dtype_name(spec.dtype)} = {format_bytes(nbytes)}, "
            f"more than the 2**63-1 bytes any variable can have"
        )
    return None


def check_specs(specs: Iterable[VariableSpec]) -> None:
    """Raise InvalidVariableError (one line naming the variable) unless every spec is valid
    (``spec_problem``), names are unique, and no variable is named like another's replica
    (``x`` and ``x/replica_1``: the replica of ``x`` on a worker's second device has that name).
    """
    names: set[str] = set()
    for spec in specs:
        problem = spec_problem(spec)
        if problem:
            raise InvalidVariableError(problem)
        if spec.name in names:
            raise InvalidVariableError(f"variable {quoted(spec.name)}: duplicate name")
        names.add(spec.name)
    for name in names:
        m = _REPLICA_SUFFIX.fullmatch(name)
        if m and m.group(1) in names:
            raise InvalidVariableError(
                f"variable {quoted(name)} is named like replica {m.group(2)} of variable {quoted(m.group(1))} "
                f"(a worker's device {m.group(2)} holds that replica under that name); rename one of them"
            )


def validate_model(specs: Iterable[VariableSpec], *, label: str) -> None:
    """``check_specs`` for a model file or source: raises ModelError prefixed with ``label``."""
    try:
        check_specs(specs)
    except InvalidVariableError as exc:
        raise ModelError(f"{label}: {exc}") from None


_HEADROOM_FRACTION = 10  # leave a tenth of the available memory ...
_HEADROOM_MIN = 256 << 20  # ... and at least 256 MiB, for the process, gRPC buffers and the OS


def available_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable (and the cgroup v2 limit less its
    usage, when there is one), less headroom; None where neither can be read (not Linux)."""
    limits = []
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as fh:
            raw = fh.read().strip()
        if raw != "max":
            with open("/sys/fs/cgroup/memory.current") as fh:
                limits.append(int(raw) - int(fh.read().strip()))
    except (OSError, ValueError):
        pass
    if not limits:
        return None
    free = max(0, min(limits))
    return max(0, free - max(free // _HEADROOM_FRACTION, _HEADROOM_MIN))


MAX_MODEL_BYTES_ENV = "COLLECTIVE_MAX_MODEL_BYTES"


def check_fits(
    specs: Sequence[VariableSpec],
    total: int,
    *,
    label: str,
    max_bytes: int | None = None,
    available: int | None | str = "auto",
) -> None:
    """Raise ModelError before a byte is allocated when the model's arena (``total`` bytes)
    exceeds ``max_bytes`` or the memory available (``available_memory()`` unless given; None:
    unknown, not checked). The message names the file, the largest variable and both sizes."""
    if available == "auto":
        available = available_memory()
    largest = max(specs, key=lambda s: s.nbytes, default=None)
    if largest is None:
        return
    what = f"{_shape_text(largest)} {_dtype_name(largest.dtype)} = {format_bytes(largest.nbytes)}"
    if largest.nbytes == total or len(specs) == 1:
        subject = f"variable {quoted(largest.name)} is {what}"
    else:
        subject = f"the model's {len(specs)} variables need {format_bytes(total)} (largest: {quoted(largest.name)} {what})"
    if max_bytes is not None and total > max_bytes:
        raise ModelError(
            f"{label}: {subject}, more than --max-model-bytes {format_bytes(max_bytes)} ({MAX_MODEL_BYTES_ENV}); "
            f"raise the limit or use a smaller model"
        )
    if isinstance(available, int) and total > available:
        raise ModelError(
            f"{label}: {subject}, more than the {format_bytes(available)} of memory available on "
            f"{os.uname().nodename} (MemAvailable less headroom); use a smaller model or a host with more memory"
        )
