"""Variable dtypes: numpy's plain numbers plus bfloat16 and float8 from ``ml_dtypes``.

A dtype travels (in plans, declarations and ``VariableSpec.dtype``) as text:

* plain numbers as numpy's canonical ``dtype.str`` (``<f4``, ``|b1``, ``>i8``): byte order is
  explicit;
* the ``ml_dtypes`` types by their name (``bfloat16``, ``float8_e4m3fn``, ...): numpy's
  ``dtype.str`` of these is a raw void (``<V2``) that says nothing of the type, so the name is
  the only faithful form. Their bytes are little-endian, as in safetensors and in memory on
  every platform the service runs on (x86-64, aarch64).

Digests are unchanged in meaning: xxh3-128 of the value's bytes, whatever the dtype, so a NaN
payload or a negative zero of a bfloat16 survives the broadcast and is checked bit for bit.
``ml_dtypes`` is imported on first use of an extended type only.
"""

from __future__ import annotations

import functools
import sys

import numpy as np

EXTENDED = (
    "bfloat16",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)
"""The ``ml_dtypes`` types a variable may have, by their wire name."""

SAFETENSORS_CODES = {
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}
"""safetensors' dtype codes of the extended types (as the ``safetensors`` package writes them)."""


@functools.cache
def _extended() -> dict[str, np.dtype]:
    if sys.byteorder != "little":  # pragma: no cover - no big-endian platform runs the service
        raise ValueError("bfloat16/float8 variables need a little-endian host")
    import ml_dtypes

    return {name: np.dtype(getattr(ml_dtypes, name)) for name in EXTENDED}


@functools.lru_cache(maxsize=256)  # asked of every variable, several times: 20,000 variables took 1.5 s
def is_extended(dtype: np.dtype) -> bool:
    """True for an ``ml_dtypes`` type of ``EXTENDED`` (never for a plain raw void)."""
    # Not by kind: bfloat16 is kind "V" but float8_e5m2 is kind "f" (with a ``<f1`` dtype.str
    # that numpy itself cannot parse back).
    return dtype.name in EXTENDED and dtype.type is not np.void and _extended()[dtype.name] == dtype


def is_float(dtype: np.dtype) -> bool:
    """Real floating point: numpy's floats and the extended types."""
    return (dtype.kind == "f" and dtype.name not in EXTENDED) or is_extended(dtype)


KINDS_HINT = (
    "use bool, int8..int64, uint8..uint64, float16, bfloat16, float32, float64, complex64, "
    f"complex128 or {', '.join(EXTENDED[1:])}"
)
"""What a refusal of a dtype tells the user to use instead."""


def problem(dtype: np.dtype) -> str | None:
    """Why ``dtype`` cannot be a variable's dtype, or None when it can: the one rule used by
    every model source, the Python API and ``create_variable``."""
    if is_extended(dtype):
        return None
    if dtype.fields is not None or dtype.subdtype is not None:
        return f"unsupported dtype {dtype.str!r} (structured or sub-array); {KINDS_HINT}"
    if dtype.kind not in "biufc":
        return f"unsupported dtype {dtype.name!r}; {KINDS_HINT}"
    if (dtype.kind == "f" and dtype.itemsize > 8) or (dtype.kind == "c" and dtype.itemsize > 16):
        # long double's memory format differs between platforms under the same dtype.str.
        return f"unsupported dtype {dtype.name!r} (platform-dependent extended precision); {KINDS_HINT}"
    return None


def wire(dtype: np.dtype) -> str:
    """The text form of ``dtype`` in specs, plans and declarations."""
    return dtype.name if is_extended(dtype) else dtype.str


@functools.lru_cache(maxsize=256)
def from_wire(text: str) -> np.dtype:
    """The dtype of a wire string (``<f4`` or ``bfloat16``); TypeError/ValueError if unknown."""
    if text in EXTENDED:
        return _extended()[text]
    return np.dtype(text)


def by_name(text: str) -> np.dtype | None:
    """The extended dtype called ``text`` (``bfloat16``, ``float8_e5m2``...), or None."""
    return _extended()[text] if text in EXTENDED else None


def is_ml_dtypes_name(text: str) -> bool:
    """True for the name of any ``ml_dtypes`` type (``float4_e2m1fn``, ``int4``...), supported or not."""
    import ml_dtypes

    return isinstance(getattr(ml_dtypes, text, None), type)


def finfo(dtype: np.dtype):
    """``np.finfo`` that knows the extended types."""
    if is_extended(dtype):
        import ml_dtypes

        return ml_dtypes.finfo(dtype)
    return np.finfo(dtype)
