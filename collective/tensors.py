"""torch tensors <-> numpy arrays, bit for bit, without importing torch until a tensor is seen.

``collective.torch`` (the hand-offs) and ``collective.snapshot`` (publish / fetch of a
``state_dict``) both cross this way: a contiguous CPU tensor becomes a numpy view of its own
memory, bfloat16 / float8 tensors their ``ml_dtypes`` type (same bits), and back with
``torch.from_numpy`` (zero copy). torch is imported inside the functions, so a process that
never holds a tensor never loads it.
"""

from __future__ import annotations

import numpy as np

from collective import dtypes
from collective.errors import UsageError

# torch dtypes numpy has no type for: the ml_dtypes type of the same bits, and the integer
# type of the same size through which the bits cross (torch.from_numpy knows no ml_dtypes).
EXTENDED = {
    "bfloat16": ("bfloat16", np.int16),
    "float8_e4m3fn": ("float8_e4m3fn", np.uint8),
    "float8_e4m3fnuz": ("float8_e4m3fnuz", np.uint8),
    "float8_e5m2": ("float8_e5m2", np.uint8),
    "float8_e5m2fnuz": ("float8_e5m2fnuz", np.uint8),
    "float8_e8m0fnu": ("float8_e8m0fnu", np.uint8),
}


def is_tensor(x: object) -> bool:
    """Whether ``x`` is a torch tensor (by its type's module: torch itself is not imported)."""
    return type(x).__module__.split(".", 1)[0] == "torch" and hasattr(x, "detach") and hasattr(x, "numpy")


def to_numpy(t) -> np.ndarray:
    """The tensor's value as a numpy array (a view for a contiguous CPU tensor; bf16/float8 as
    their ``ml_dtypes`` type, same bits)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if name not in EXTENDED:
        return t.numpy()
    bits = EXTENDED[name][1]
    return t.view(torch.int16 if bits is np.int16 else torch.uint8).numpy().view(dtypes.from_wire(name))


def from_numpy(a: np.ndarray):
    """A CPU tensor sharing ``a``'s memory (bf16/float8 through their integer bits)."""
    import torch

    if dtypes.is_extended(a.dtype):
        name = a.dtype.name
        torch_dtype = getattr(torch, name, None)
        if torch_dtype is None:
            raise UsageError(f"this torch {torch.__version__} has no {name} type")
        bits = EXTENDED[name][1]
        return torch.from_numpy(a.view(bits)).view(torch_dtype)
    return torch.from_numpy(a)
