"""Mirrored and sync-on-read variables over numpy, with TensorFlow's semantics.

A distributed variable is one logical variable held as one independent numpy array per device
(its *replicas*). ``create_variable`` is the only supported way to make one: it validates the
definition, builds the replicas and registers the variable in a ``VariableStore``.

* ``MirroredVariable`` (``ON_WRITE``; ``AUTO`` means this): every write leaves all replicas
  equal. A per-replica write combines the values by the variable's aggregation first.
* ``SyncOnReadVariable`` (``ON_READ``): each replica keeps its own value; reading combines
  them by the aggregation. Never trainable.

Per-replica values combine like this:

* ``SUM``: element-wise sum, cast back to the variable's dtype.
* ``MEAN``: element-wise mean, cast back to the dtype (integers truncate toward zero, like
  TensorFlow's integer ``reduce_mean``).
* ``ONLY_FIRST_REPLICA``: replica 0's value.
* ``NONE``: allowed only when every value is equal (NaNs in the same places count as equal);
  otherwise an ``InvalidVariableError``.

Every error raised here is an ``InvalidVariableError`` (a ``ValueError``) whose message starts
with ``variable '<name>':``, except creating a variable in a started store, which is a
``FrozenError`` (a ``RuntimeError``).
"""

from __future__ import annotations

import abc
import difflib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from collective import dtypes
from collective.errors import FrozenError, InvalidVariableError
from collective.model import Aggregation, Synchronization, VariableSpec

__all__ = [
    "DistributedVariable",
    "MirroredVariable",
    "SyncOnReadVariable",
    "VariableStore",
    "create_variable",
    "default_store",
    "variable_over",
    "replica_name",
    "reset_default_store",
]

GLOBAL_STEP_NAME = "global_step"

# bool, signed and unsigned integers, floats, complex: the kinds a tensor can hold. Strings,
# objects, datetimes and structured dtypes have no meaning as model variables.
_NUMERIC_KINDS = frozenset("biufc")


def replica_name(name: str, index: int) -> str:
    """The name of replica ``index`` of variable ``name``.

    Replica 0 keeps the variable's name; replica ``i > 0`` is ``"<name>/replica_<i>"``, as in
    TensorFlow's MirroredStrategy.
    """
    return name if index == 0 else f"{name}/replica_{index}"


def _fail(name: str, message: str) -> InvalidVariableError:
    return InvalidVariableError(f"variable {name!r}: {message}")


def _shape_text(shape: tuple[int, ...]) -> str:
    return str(tuple(shape))


def _values_equal(a: np.ndarray, b: np.ndarray) -> bool:
    # equal_nan: replicas holding NaN in the same places hold the same value. It is only
    # meaningful (and only accepted by numpy) for inexact dtypes.
    if dtypes.is_extended(a.dtype):  # bfloat16/float8: compare as float32 (exact widening)
        a, b = a.astype(np.float32), np.asarray(b).astype(np.float32)
    return bool(np.array_equal(a, b, equal_nan=np.issubdtype(a.dtype, np.inexact)))


class DistributedVariable(abc.ABC):
    """One logical variable held as one independent numpy array per device.

    Instances come from ``create_variable``; the constructor trusts its arguments (they were
    validated there) and takes ownership of ``replicas``.

    Guarantees: ``replicas`` has one array per device, in device order, all of the variable's
    shape and dtype, and no two share memory. Every assignment is validated in full before any
    replica is written, so a rejected assignment leaves the variable unchanged. Assignments
    write into the existing arrays (in place), so an array obtained from ``replicas`` (for
    example a receive buffer shared with ``share_first=True``) stays the live replica.
    """

    synchronization: Synchronization

    def __init__(
        self,
        *,
        name: str,
        replicas: list[np.ndarray],
        devices: tuple[str, ...],
        aggregation: Aggregation,
        trainable: bool,
    ) -> None:
        self._name = name
        self._replicas = replicas
        self._devices = devices
        self._aggregation = aggregation
        self._trainable = trainable

    # -- description ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def replicas(self) -> list[np.ndarray]:
        """The replica arrays themselves, one per device in device order (a new list each call).

        Mutating an array changes that replica only.
        """
        return list(self._replicas)

    @property
    def replica_names(self) -> list[str]:
        """``[name, name/replica_1, name/replica_2, ...]``, one per device."""
        return [replica_name(self._name, i) for i in range(len(self._replicas))]

    @property
    def devices(self) -> tuple[str, ...]:
        return self._devices

    @property
    def aggregation(self) -> Aggregation:
        return self._aggregation

    @property
    def trainable(self) -> bool:
        return self._trainable

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._replicas[0].shape)

    @property
    def dtype(self) -> np.dtype:
        return self._replicas[0].dtype

    @property
    def spec(self) -> VariableSpec:
        """The variable's ``VariableSpec`` (``AUTO`` already resolved to ``ON_WRITE``)."""
        return VariableSpec(
            name=self._name,
            shape=self.shape,
            dtype=dtypes.wire(self.dtype),
            synchronization=self.synchronization,
            aggregation=self._aggregation,
            trainable=self._trainable,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self._name!r}, shape={self.shape}, "
            f"dtype={self.dtype.name}, devices={list(self._devices)}, "
            f"aggregation={self._aggregation.name}, trainable={self._trainable})"
        )

    # -- reading and writing -------------------------------------------------------------------

    @abc.abstractmethod
    def read_value(self) -> np.ndarray:
        """The variable's value as a new array (never one of the replicas)."""

    def assign(self, value: Any) -> None:
        """Set the variable from one value, or from one value per replica.

        Rule: a Python ``list`` or ``tuple`` whose elements are all ``np.ndarray`` of exactly the
        variable's shape is one value per replica and goes to ``assign_per_replica``. (Stacked,
        such a list would have one more dimension than the variable, so it can never be a valid
        single value.) Anything else is one value written to every replica.

        A value must have the variable's shape and a dtype numpy can cast to the variable's
        dtype within the same kind (float64 into float32 is fine, float into int is not).
        Raises InvalidVariableError otherwise.
        """
        if self._is_per_replica(value):
            self.assign_per_replica(value)
            return
        array = self._coerce(value)
        for replica in self._replicas:
            replica[...] = array

    def assign_per_replica(self, values: Any) -> None:
        """Assign one value per replica, in device order.

        ``values`` is any iterable (a list, a tuple, or an array iterated over its first axis)
        with exactly one value per device. What happens next depends on the variable kind: a
        mirrored variable combines them by its aggregation and stores the result in every
        replica; a sync-on-read variable stores each value in its own replica. Raises
        InvalidVariableError for a wrong count, shape or dtype, or (mirrored, aggregation
        NONE) for differing values.
        """
        if isinstance(values, (str, bytes)):
            raise _fail(self._name, "per-replica values must be a sequence of arrays, not a string")
        try:
            items = list(values)
        except TypeError:
            raise _fail(
                self._name,
                f"per-replica values must be a sequence with one value per device, "
                f"got {type(values).__name__}",
            ) from None
        if len(items) != len(self._replicas):
            raise _fail(
                self._name,
                f"expected {len(self._replicas)} per-replica values (one per device), "
                f"got {len(items)}",
            )
        arrays = [self._coerce(item) for item in items]
        self._store_per_replica(arrays)

    @abc.abstractmethod
    def _store_per_replica(self, arrays: list[np.ndarray]) -> None:
        """Write validated per-replica values (fresh arrays of the right shape and dtype)."""

    # -- helpers -------------------------------------------------------------------------------

    def _is_per_replica(self, value: Any) -> bool:
        return (
            isinstance(value, (list, tuple))
            and len(value) > 0
            and all(isinstance(v, np.ndarray) and v.shape == self.shape for v in value)
        )

    def _coerce(self, value: Any) -> np.ndarray:
        """``value`` as a fresh array of the variable's shape and dtype, or InvalidVariableError.

        Always a copy: the value may alias a replica (``v.assign(v.replicas[1])``), and the
        replicas are written one after another.
        """
        try:
            array = np.asarray(value)
        except (ValueError, TypeError) as exc:
            raise _fail(self._name, f"cannot assign {type(value).__name__}: {exc}") from exc
        if array.shape != self.shape:
            raise _fail(
                self._name,
                f"cannot assign a value of shape {_shape_text(array.shape)} "
                f"to a variable of shape {_shape_text(self.shape)}",
            )
        if not np.can_cast(array.dtype, self.dtype, casting="same_kind"):
            raise _fail(
                self._name,
                f"cannot assign a value of dtype {array.dtype.name} "
                f"to a variable of dtype {self.dtype.name}",
            )
        return np.array(array, dtype=self.dtype, copy=True)

    def _combine(self, arrays: list[np.ndarray]) -> np.ndarray:
        """Combine per-replica values by the aggregation into a new array of the dtype."""
        aggregation = self._aggregation
        if aggregation is Aggregation.ONLY_FIRST_REPLICA:
            return arrays[0].copy()
        if aggregation is Aggregation.NONE:
            first = arrays[0]
            if all(_values_equal(first, other) for other in arrays[1:]):
                return first.copy()
            raise _fail(
                self._name,
                "aggregation NONE cannot combine differing per-replica values; "
                "use SUM, MEAN or ONLY_FIRST_REPLICA, or make the values equal",
            )
        stacked = np.stack(arrays)
        if aggregation is Aggregation.SUM:
            combined = stacked.sum(axis=0)
        elif aggregation is Aggregation.MEAN:
            combined = stacked.mean(axis=0)
        else:  # pragma: no cover - the enum has exactly the four members above
            raise _fail(self._name, f"unsupported aggregation {aggregation!r}")
        # numpy widens small integers in sum and returns floats from mean; the variable's
        # dtype is part of its contract, so cast back (truncating integer means toward zero).
        return np.asarray(combined).astype(self.dtype, copy=False)


class MirroredVariable(DistributedVariable):
    """An ``ON_WRITE`` variable: after every write, all replicas hold the same value."""

    synchronization = Synchronization.ON_WRITE

    def read_value(self) -> np.ndarray:
        """A copy of replica 0 (all replicas are equal after any write through this API)."""
        return self._replicas[0].copy()

    def _store_per_replica(self, arrays: list[np.ndarray]) -> None:
        combined = self._combine(arrays)
        for replica in self._replicas:
            replica[...] = combined


class SyncOnReadVariable(DistributedVariable):
    """An ``ON_READ`` variable: replicas hold their own values; reading aggregates them.

    As in TensorFlow, ``assign(value)`` from outside a replica context makes a following
    ``read_value()`` return ``value``: with aggregation SUM each replica gets ``value / N``
    (cast to the dtype), with the other aggregations each replica gets ``value``.
    """

    synchronization = Synchronization.ON_READ

    def assign(self, value: Any) -> None:
        if self._is_per_replica(value) or self.aggregation is not Aggregation.SUM:
            super().assign(value)
            return
        array = self._coerce(value)
        share = (array / len(self._replicas)).astype(self.dtype, copy=False)
        for replica in self._replicas:
            replica[...] = share

    def read_value(self) -> np.ndarray:
        """The replicas combined by the aggregation, as a new array.

        Raises InvalidVariableError when the aggregation is NONE and the replicas differ.
        """
        return self._combine(self._replicas)

    def _store_per_replica(self, arrays: list[np.ndarray]) -> None:
        for replica, array in zip(self._replicas, arrays, strict=True):
            replica[...] = array


class VariableStore:
    """The variable set of one process: the ``global_variables`` / ``trainable_variables``
    collections, and the freeze at training start.

    Guarantees: variables are listed in the order they were added; names are unique; once
    ``start()`` has been called no variable can be added (FrozenError). Collections list the
    distributed variables themselves, never their component replicas. Safe to use from
    several threads.
    """

    def __init__(self) -> None:
        # A name maps to its variable, or to a _Pending index until the variable is first used.
        self._variables: dict[str, DistributedVariable | _Pending] = {}
        self._deferred: tuple[Callable[[], Sequence[str]], Callable[[int], DistributedVariable]] | None = None
        self._make: Callable[[int], DistributedVariable] | None = None
        self._started = False
        # One lock for the name check, the freeze check and the insert, so two threads can
        # neither add the same name nor slip a variable in after start().
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self._started

    def start(self) -> None:
        """Mark training as started and freeze the variable set. Calling it again is a no-op."""
        with self._lock:
            self._started = True

    def add(self, variable: DistributedVariable) -> None:
        """Register ``variable``.

        Raises FrozenError after ``start()``, InvalidVariableError if the name is taken.
        """
        self._add(variable, verb="add")

    def defer(self, names: Callable[[], Sequence[str]], make: Callable[[int], DistributedVariable]) -> None:
        """Register variables whose objects are made on first use: ``make(i)`` for ``names()[i]``.

        For a worker that holds 20,000 verified variables in its arenas: registering them costs
        nothing per variable, and each Python object is built the first time the variable is
        read (``get``, the collections, iteration), in the order given. Allowed once, on an
        empty store.
        """
        with self._lock:
            if self._started or self._variables or self._deferred is not None:
                raise FrozenError("deferred variables can only be registered in an empty, unstarted store")
            self._deferred = (names, make)

    def get(self, name: str) -> DistributedVariable:
        """The variable called ``name`` (also ``store[name]``).

        Raises KeyError naming the closest existing names when there is no such variable, so a
        typo or another model's name is caught where it is made, not as a None further on.
        """
        with self._lock:
            self._index()
            if name in self._variables:
                return self._resolve(name)
            names = list(self._variables)
        close = difflib.get_close_matches(str(name), names, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise KeyError(f"no variable named {name!r} among the {len(names)} in this store{hint}")

    def __getitem__(self, name: str) -> DistributedVariable:
        return self.get(name)

    @property
    def global_variables(self) -> list[DistributedVariable]:
        """Every variable (mirrored and sync-on-read), in the order they were added."""
        return self._all()

    @property
    def trainable_variables(self) -> list[DistributedVariable]:
        """The trainable variables, in the order they were added (never sync-on-read ones)."""
        return [v for v in self._all() if v.trainable]

    @property
    def global_step(self) -> DistributedVariable | None:
        """The variable named ``"global_step"``, or None."""
        return self.get(GLOBAL_STEP_NAME) if GLOBAL_STEP_NAME in self else None

    def __len__(self) -> int:
        with self._lock:
            self._index()
            return len(self._variables)

    def __iter__(self) -> Iterator[DistributedVariable]:
        return iter(self._all())

    def __contains__(self, name: object) -> bool:
        with self._lock:
            self._index()
            return name in self._variables

    def _all(self) -> list[DistributedVariable]:
        with self._lock:
            self._index()
            return [self._resolve(name) for name in self._variables]

    def _index(self) -> None:
        # Under self._lock: list the deferred names (in order) as pending slots.
        if self._deferred is None:
            return
        names, self._make = self._deferred
        self._deferred = None
        for i, name in enumerate(names()):
            self._variables[name] = _Pending(i)

    def _resolve(self, name: str) -> DistributedVariable:
        # Under self._lock; assigning to an existing key keeps the order of the store.
        value = self._variables[name]
        if isinstance(value, _Pending):
            value = self._variables[name] = self._make(value.index)
        return value

    def _add(self, variable: DistributedVariable, *, verb: str) -> None:
        # ``verb`` only words the FrozenError: create_variable reports "cannot create".
        with self._lock:
            self._index()
            self._check_can_add(variable.name, verb=verb)
            self._variables[variable.name] = variable

    def _check_can_add(self, name: str, *, verb: str) -> None:
        # Callers that need atomicity with the insert hold self._lock.
        if self._started:
            raise FrozenError(
                f"cannot {verb} variable {name!r}: "
                "the variable set is frozen once training has started"
            )
        if name in self._variables:
            raise _fail(name, "a variable with this name already exists in the store")


class _Pending:
    """A deferred variable not made yet: its index in the deferred names."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


_default_store = VariableStore()
_default_store_lock = threading.Lock()


def default_store() -> VariableStore:
    """The process-wide store that ``create_variable`` uses when given ``store=None``."""
    with _default_store_lock:
        return _default_store


def reset_default_store() -> VariableStore:
    """Replace the process-wide store with a new, empty, unstarted one, and return it."""
    global _default_store
    with _default_store_lock:
        _default_store = VariableStore()
        return _default_store


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name.strip():
        raise InvalidVariableError(f"a variable name must be a non-empty string, got {name!r}")
    return name


def _check_devices(name: str, devices: object) -> tuple[str, ...]:
    # A bare string is a Sequence too; "cpu:0" would otherwise become five one-letter devices.
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise _fail(name, f"devices must be a list of device strings, got {devices!r}")
    if len(devices) == 0:
        raise _fail(name, "at least one device is required")
    seen: set[str] = set()
    for device in devices:
        if not isinstance(device, str) or not device.strip():
            raise _fail(name, f"a device must be a non-empty string like 'cpu:0', got {device!r}")
        if device in seen:
            raise _fail(name, f"device {device!r} is listed more than once")
        seen.add(device)
    return tuple(devices)


def _parse_modes(
    name: str, synchronization: object, aggregation: object
) -> tuple[Synchronization, Aggregation]:
    try:
        sync = Synchronization.parse(synchronization, variable=name)
        agg = Aggregation.parse(aggregation, variable=name)
    except ValueError as exc:
        # The parse message already names the mode and the variable.
        raise InvalidVariableError(str(exc)) from exc
    if sync is Synchronization.NONE:
        raise _fail(
            name,
            "synchronization NONE is not allowed; use AUTO, ON_WRITE (mirrored) "
            "or ON_READ (sync-on-read)",
        )
    if sync is Synchronization.AUTO:
        sync = Synchronization.ON_WRITE
    return sync, agg


def _resolve_trainable(name: str, trainable: object, sync: Synchronization) -> bool:
    if trainable is None:
        return sync is not Synchronization.ON_READ
    if not isinstance(trainable, (bool, np.bool_)):
        raise _fail(name, f"trainable must be True, False or None, got {trainable!r}")
    if trainable and sync is Synchronization.ON_READ:
        raise _fail(
            name,
            "a sync-on-read (ON_READ) variable cannot be trainable; "
            "pass trainable=False or None, or use ON_WRITE",
        )
    return bool(trainable)


def _initial_array(name: str, initial_value: object) -> tuple[object, np.ndarray]:
    """(the value as given or as the callable produced it, that value as an array)."""
    if initial_value is None:
        raise _fail(name, "an initial value is required")
    if callable(initial_value):
        initial_value = initial_value()
        if initial_value is None:
            raise _fail(name, "the initial value callable returned None")
    try:
        array = np.asarray(initial_value)
    except (ValueError, TypeError) as exc:
        raise _fail(name, f"the initial value is not an array: {exc}") from exc
    if array.dtype.kind not in _NUMERIC_KINDS and not dtypes.is_extended(array.dtype):
        raise _fail(name, f"the initial value must be numeric or boolean, got dtype {array.dtype}")
    problem = dtypes.problem(array.dtype)  # the rule every model source applies
    if problem:
        raise _fail(name, f"the initial value's {problem}")
    return initial_value, array


def create_variable(
    name: str,
    initial_value: Any | Callable[[], Any],
    devices: Sequence[str],
    synchronization: Synchronization | str = Synchronization.AUTO,
    aggregation: Aggregation | str = Aggregation.NONE,
    trainable: bool | None = None,
    *,
    store: VariableStore | None = None,
    share_first: bool = False,
) -> MirroredVariable | SyncOnReadVariable:
    """Create a distributed variable with one replica per device and register it in ``store``.

    ``synchronization`` and ``aggregation`` are enum members or their names in any case
    (``"on_read"``). ``AUTO`` means ``ON_WRITE`` and gives a ``MirroredVariable``; ``ON_READ``
    gives a ``SyncOnReadVariable``; ``NONE`` is rejected. ``trainable=None`` means True, except
    for ``ON_READ`` where it means False; ``ON_READ`` with ``trainable=True`` is rejected.

    ``initial_value`` is a numeric or boolean array-like, or a callable taking no arguments
    that returns one; the callable is called exactly once, and only after every other argument
    has been validated and the store has been checked. The variable's shape and dtype are
    those of the initial value.

    Every replica is a fresh copy of the initial value, except with ``share_first=True``: when
    the initial value (or the callable's result) is a writeable plain ``np.ndarray``, replica 0
    *is* that array (zero-copy, for a worker that received the bytes into its own buffer) and
    the other replicas are copies. A read-only array or a non-array is copied even then, since
    replicas must be writeable.

    ``store=None`` means ``default_store()``. Raises FrozenError if the store has started,
    InvalidVariableError (naming the variable) for any invalid argument or a taken name.
    """
    name = _check_name(name)
    target = default_store() if store is None else store
    # Check the store before doing any work (in particular before running an initializer):
    # the freeze and name clash are the errors the caller most needs to hear about. add()
    # checks again under the lock.
    with target._lock:
        target._check_can_add(name, verb="create")
    device_tuple = _check_devices(name, devices)
    sync, agg = _parse_modes(name, synchronization, aggregation)
    is_trainable = _resolve_trainable(name, trainable, sync)
    produced, array = _initial_array(name, initial_value)

    # np.asarray hands back the very object for a plain ndarray, so `array is produced` means
    # the caller's own array (or the callable's own result), not a conversion of something.
    share = share_first and array is produced and array.flags.writeable
    first = array if share else array.copy()
    replicas = [first] + [array.copy() for _ in device_tuple[1:]]

    variable = _construct(name, replicas, device_tuple, sync, agg, is_trainable)
    target._add(variable, verb="create")
    return variable


def _construct(
    name: str, replicas: list[np.ndarray], devices: tuple[str, ...], sync: Synchronization, agg: Aggregation,
    trainable: bool,
) -> MirroredVariable | SyncOnReadVariable:
    cls = SyncOnReadVariable if sync is Synchronization.ON_READ else MirroredVariable
    return cls(name=name, replicas=replicas, devices=devices, aggregation=agg, trainable=trainable)


def variable_over(
    name: str,
    replicas: Sequence[np.ndarray],
    devices: Sequence[str],
    synchronization: Synchronization | str = Synchronization.AUTO,
    aggregation: Aggregation | str = Aggregation.NONE,
    trainable: bool | None = None,
) -> MirroredVariable | SyncOnReadVariable:
    """A distributed variable whose replicas *are* the given writeable arrays (no copy), one per
    device, all of one shape and dtype: for a worker whose replicas live in its arenas. The same
    checks as ``create_variable``; not registered in any store (see ``VariableStore.defer``)."""
    name = _check_name(name)
    device_tuple = _check_devices(name, devices)
    sync, agg = _parse_modes(name, synchronization, aggregation)
    is_trainable = _resolve_trainable(name, trainable, sync)
    arrays = list(replicas)
    if len(arrays) != len(device_tuple):
        raise _fail(name, f"{len(arrays)} replicas for {len(device_tuple)} devices")
    first = arrays[0]
    for a in arrays:
        if not isinstance(a, np.ndarray) or not a.flags.writeable or (a.shape, a.dtype) != (first.shape, first.dtype):
            raise _fail(name, "replicas must be writeable arrays of one shape and dtype")
    return _construct(name, arrays, device_tuple, sync, agg, is_trainable)
