"""Variable specifications and the enums of TensorFlow's variable semantics.

A ``VariableSpec`` is what both sides agree on before any bytes move: name, shape, dtype and
the synchronization/aggregation modes. Values are never part of a spec; a model *source*
(``collective.sources``) fills them into buffers the caller provides, so the chief can
materialise a model straight into its send arena without an extra copy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from collective import dtypes


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
        raise ValueError(f"unknown {cls.__name__.lower()} {value!r}{where}; use one of {allowed}")


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
