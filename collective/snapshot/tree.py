"""A published state as tensors plus a JSON skeleton, and back.

``flatten`` walks a state (a mapping name -> array, or a nested torch ``state_dict`` /
optimizer ``state_dict()``: dicts, lists and tuples nesting tensors and plain values) and
returns its tensor leaves, each under the name of its key path (``layer.0.weight``,
``state/0/exp_avg``), and a skeleton: the structure as JSON, each tensor replaced by its name.
The skeleton travels as one more variable of the plan (``TREE``: UTF-8 bytes), so it is chunked,
striped and verified by digest like every tensor, and the manifest digest covers it.

Nothing is ever pickled: a leaf that is neither a tensor nor a JSON value (int, float, bool,
None, str) is a UsageError naming its key path, and ``unflatten`` accepts only the node kinds
below, within ``MAX_TREE_DEPTH`` and ``MAX_TREE_BYTES``, so a hostile skeleton is a
ProtocolError, never an object built from what a peer chose.

Skeleton nodes (each a JSON object with one key)::

    {"a": NAME}                     a tensor leaf: the plan's variable NAME
    {"d": [[KEY, NODE], ...]}       a dict, in order; KEY a string or an integer (optimizer state)
    {"l": [NODE, ...]}              a list
    {"t": [NODE, ...]}              a tuple (Adam's betas)
    {"v": VALUE}                    a JSON scalar
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import numpy as np

from collective import dtypes, tensors
from collective.errors import ProtocolError, UsageError
from collective.limits import MAX_SNAPSHOT_TREE_BYTES, MAX_SNAPSHOT_TREE_DEPTH
from collective.model import quoted

TREE = "#tree"
"""The plan variable that holds the skeleton (a key path of that name is refused)."""

FORMAT = 1
MAX_TREE_DEPTH = MAX_SNAPSHOT_TREE_DEPTH
MAX_TREE_BYTES = MAX_SNAPSHOT_TREE_BYTES
_KINDS = set("biufc")


def _path(keys: tuple) -> str:
    return "".join(f"[{k!r}]" for k in keys) or "(the top level)"


def leaf_array(x, keys: tuple = ()) -> np.ndarray | None:
    """``x`` as a numpy array if it is a tensor leaf (numpy array or scalar, torch tensor), else
    None. UsageError for a tensor that cannot travel (a device tensor, an object dtype)."""
    if tensors.is_tensor(x):
        if x.device.type != "cpu":
            raise UsageError(f"state{_path(keys)}: a tensor on {x.device}; publish CPU tensors (.cpu() first)")
        arr = tensors.to_numpy(x)
    elif isinstance(x, (np.ndarray, np.generic)):
        arr = np.asarray(x)
    else:
        return None
    if arr.dtype.kind not in _KINDS and not dtypes.is_extended(arr.dtype) or arr.dtype.fields is not None:
        raise UsageError(f"state{_path(keys)}: dtype {arr.dtype} cannot travel (numbers only; nothing is pickled)")
    return arr


def flatten(state: Mapping) -> tuple[dict, dict[str, np.ndarray]]:
    """(skeleton, name -> array) of ``state``, arrays in the order met. UsageError naming the key
    path of a leaf that is neither a tensor nor a JSON value, or of two paths with one name."""
    if not isinstance(state, Mapping):
        raise UsageError(f"publish takes a mapping (name -> tensor, or a state_dict), not a {type(state).__name__}")
    arrays: dict[str, np.ndarray] = {}
    where: dict[str, tuple] = {}

    def walk(x, keys: tuple) -> dict:
        if len(keys) > MAX_TREE_DEPTH:
            raise UsageError(f"state{_path(keys[:4])}...: nested deeper than {MAX_TREE_DEPTH} levels")
        arr = leaf_array(x, keys)
        if arr is not None:
            name = "/".join(str(k) for k in keys)
            if name in where or name == TREE or not name:
                other = f"state{_path(where[name])} has the same name" if name in where else "that name is reserved"
                raise UsageError(f"state{_path(keys)}: its tensor would be named {name!r}, and {other}; rename a key")
            arrays[name], where[name] = arr, keys
            return {"a": name}
        if isinstance(x, Mapping):
            items = []
            for k, v in x.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise UsageError(f"state{_path(keys)}: key {k!r} is a {type(k).__name__}; keys must be str or int")
                items.append([k, walk(v, (*keys, k))])
            return {"d": items}
        if isinstance(x, (list, tuple)):
            return {"t" if isinstance(x, tuple) else "l": [walk(v, (*keys, i)) for i, v in enumerate(x)]}
        if x is None or isinstance(x, (bool, int, str)) or (isinstance(x, float) and math.isfinite(x)):
            return {"v": x}
        if isinstance(x, float):  # NaN / inf are not JSON: they travel as their names
            return {"f": repr(x)}
        raise UsageError(f"state{_path(keys)}: a {type(x).__name__} is neither a tensor nor a JSON value "
                         f"(int, float, bool, None, str, or lists/dicts of them); nothing is pickled")

    return walk(state, ()), arrays


def encode(skeleton: dict, step: int) -> np.ndarray:
    """The skeleton and the step as the TREE variable's bytes (UTF-8 JSON)."""
    data = json.dumps({"format": FORMAT, "step": step, "tree": skeleton}, separators=(",", ":"),
                      ensure_ascii=False, allow_nan=False).encode()
    if len(data) > MAX_TREE_BYTES:
        raise UsageError(f"the state's structure takes {len(data)} bytes as JSON, more than {MAX_TREE_BYTES}; "
                         f"publish fewer non-tensor values")
    return np.frombuffer(data, dtype=np.uint8)


def decode(data: np.ndarray, step: int, sender: str) -> dict:
    """The skeleton in the TREE bytes ``data``; ProtocolError naming ``sender`` unless they are
    JSON of this format and say ``step``. Only JSON is parsed: nothing is unpickled or run."""
    if data.nbytes > MAX_TREE_BYTES:
        raise ProtocolError(f"{sender} sent a structure of {data.nbytes} bytes, more than {MAX_TREE_BYTES}")
    try:
        doc = json.loads(bytes(memoryview(data)).decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"{sender} sent a structure that is not JSON ({type(exc).__name__}); refused, "
                            f"nothing in it was run") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("tree"), dict):
        raise ProtocolError(f"{sender} sent a structure that is not a snapshot skeleton of format {FORMAT}")
    if doc.get("step") != step or isinstance(doc.get("step"), bool):
        raise ProtocolError(f"{sender} sent a structure of step {quoted(doc.get('step'))} in its plan of step {step}")
    return doc["tree"]


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def unflatten(skeleton: dict, arrays: Mapping[str, np.ndarray], sender: str) -> dict:
    """The state ``skeleton`` describes, its tensor leaves taken from ``arrays`` (each used once;
    every one of them used). ProtocolError naming ``sender`` for anything else."""
    used: set[str] = set()

    def bad(what: str) -> ProtocolError:
        return ProtocolError(f"{sender} sent a structure that is not a snapshot skeleton: {what}")

    def build(node, depth: int):
        if depth > MAX_TREE_DEPTH + 1:
            raise bad(f"nested deeper than {MAX_TREE_DEPTH} levels")
        if not isinstance(node, dict) or len(node) != 1:
            raise bad(f"a node is a {type(node).__name__} of {len(node) if isinstance(node, dict) else '?'} keys")
        (kind, value), = node.items()
        if kind == "a":
            if not isinstance(value, str) or value not in arrays or value in used or value == TREE:
                raise bad(f"tensor leaf {str(value)[:80]!r} is not a variable of its plan, or used twice")
            used.add(value)
            return arrays[value]
        if kind == "d" and isinstance(value, list):
            out = {}
            for item in value:
                if (not isinstance(item, list) or len(item) != 2 or isinstance(item[0], bool)
                        or not isinstance(item[0], (str, int))):
                    raise bad("a dict entry is not [str or int key, node]")
                out[item[0]] = build(item[1], depth + 1)
            return out
        if kind in ("l", "t") and isinstance(value, list):
            items = [build(v, depth + 1) for v in value]
            return tuple(items) if kind == "t" else items
        if kind == "v" and (value is None or isinstance(value, (bool, int, float, str))):
            return value
        if kind == "f" and value in ("nan", "inf", "-inf"):
            return float(value)
        raise bad(f"a node of kind {quoted(kind)} holding a {type(value).__name__}")  # the peer's key: cut

    state = build(skeleton, 0)
    if not isinstance(state, dict):
        raise bad("its top level is not a dict")
    unused = [n for n in arrays if n not in used and n != TREE]
    if unused:
        raise bad(f"{len(unused)} variable(s) of its plan are in no leaf (first: {unused[0][:80]!r})")
    return state
