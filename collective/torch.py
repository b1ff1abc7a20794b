"""PyTorch hand-off: every rank's module starts from rank 0's parameters and buffers.

::

    import collective.torch
    model = Net()                                   # each rank initialises its own
    collective.torch.sync_module(model)             # now every rank holds rank 0's values
    ddp = DistributedDataParallel(model, init_sync=False)   # no second broadcast

Later, at any training step, ``check_module(model, step=step)`` on every rank asks whether all
ranks still hold the same parameters and buffers (``collective.check``: one digest per rank
travels, not the values); a difference raises ``DivergenceError`` on every rank, naming the
tensors and ranks.

``sync_module`` reads the module's ``state_dict()`` (names, shapes, dtypes: the declaration of
every rank, so a rank whose model differs fails with every difference listed before any byte
moves), calls ``collective.sync`` with it and writes the verified values back into the very
tensors of the module, in place (optimizers built before keep working):

* a CPU tensor takes the received replica's memory (``torch.from_numpy``: zero-copy; the arena
  is this process's own copy-on-write or private memory);
* a device tensor (``cuda:i``, ``mps``) gets a copy, read back and checked against the
  variable's digest (a device that corrupted the copy is an IntegrityError naming it).

Works the same under ``torchrun`` (roles from ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``; the
chief listens at ``MASTER_PORT + 1``), ``mpiexec`` and ``COLLECTIVE_*``. bfloat16 and float8
tensors travel as ``ml_dtypes`` arrays, bit for bit.

A sharded module (FSDP2's ``fully_shard``, or parameters made DTensors with ``Shard(0)`` /
``Replicate`` over a mesh of every rank: 1-D, or 2-D for HSDP's ``(Replicate(), Shard(0))``)
gets only its local shards::

    full = Net().state_dict() if rank == 0 else None   # rank 0's whole values (or a checkpoint path)
    model = Net(); fully_shard(model, mesh=mesh)
    collective.torch.sync_module(model, mesh=mesh, values=full)

Each rank receives only its rows (``collective.shards``: a plan of its own, verified by digest),
about model / world bytes, and writes them into each DTensor's local tensor in place; plain
tensors (buffers) and ``Replicate`` DTensors get the whole value. Over gRPC, or under mpiexec
(each rank's stream point to point from rank 0).

Every step of a training run (issue 38: a trainer and its inference processes)::

    pub = collective.torch.publish_module(model, step=0, token=token)          # trainer
    pub.update(collective.torch.module_state(model), step=step)                 # after each step
    sub = collective.torch.subscribe(model, pub.address, token=token)          # follower
    sub.apply()                                 # between two uses: the next step, in place, verified

The follower's parameters and buffers are the subscription's arrays (numpy views of the same
``Parameter`` objects' memory), so each step lands in them as its changed elements, verified by
digest; ``optimizer=`` on both sides carries the optimizer's state and hyper-parameters too.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

import collective
from collective import dtypes
from collective._api import release_freed_memory
from collective.digest import array_digest
from collective.errors import IntegrityError, UsageError
from collective.tensors import from_numpy, to_numpy  # the crossing, shared with collective.snapshot

__all__ = ["sync_module", "check_module", "state_arrays", "load_arrays", "module_device", "local_device",
           "as_tensors", "load_state", "receive_targets", "module_state", "publish_module", "subscribe",
           "ModuleSubscription"]


def state_arrays(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """``module.state_dict()`` as numpy arrays, in its order (views of CPU tensors)."""
    return {name: to_numpy(t) for name, t in module.state_dict(keep_vars=True).items()}


def local_device(environ: Mapping[str, str] | None = None) -> torch.device:
    """The device this process trains on, as torchrun users pick it: ``cuda:<local rank>`` when
    CUDA is available (``collective.local_rank()``: torchrun's ``LOCAL_RANK``, Open MPI's,
    Hydra's, Slurm's, ``COLLECTIVE_LOCAL_RANK``), else ``mps`` when available, else ``cpu``.
    UsageError when the local rank has no CUDA device of its own (more processes on the host
    than visible GPUs)."""
    rank = collective.local_rank(environ)
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if rank >= count:
            raise UsageError(f"local rank {rank} has no CUDA device: this host shows {count} "
                             f"(CUDA_VISIBLE_DEVICES); start at most {count} processes per host")
        return torch.device("cuda", rank)
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def module_device(module: torch.nn.Module) -> str:
    """The collective device name of the module's tensors (``cpu:0``, ``cuda:1``, ``mps:0``);
    UsageError when they are spread over several devices."""
    found = {t.device for t in module.state_dict(keep_vars=True).values()}
    if len(found) > 1:
        raise UsageError(f"the module's tensors are on several devices ({', '.join(sorted(map(str, found)))}); "
                         "pass devices= or move the module to one device first")
    device = next(iter(found), torch.device("cpu"))
    return f"{device.type}:{device.index or 0}"


def load_arrays(module: torch.nn.Module, arrays: Mapping[str, np.ndarray], *, zero_copy: bool = True) -> int:
    """Write ``arrays`` (name -> value, the names of ``state_dict()``) into the module's own
    tensors, in place. CPU tensors take the arrays' memory (zero-copy; the number of such
    tensors is returned); device tensors (and CPU ones with ``zero_copy=False``) get a copy
    that is read back and checked against the value's digest.
    """
    return _write(module.state_dict(keep_vars=True), arrays, zero_copy=zero_copy)


def _write(targets: Mapping[str, torch.Tensor], arrays: Mapping[str, np.ndarray], *, zero_copy: bool) -> int:
    """``load_arrays`` into given tensors (name -> tensor)."""
    missing = [n for n in targets if n not in arrays]
    if missing:
        raise UsageError(f"no value for {len(missing)} tensor(s) of the module: {', '.join(missing[:5])}")
    shared = 0
    with torch.no_grad():
        for name, t in targets.items():
            a = arrays[name]
            src = from_numpy(a)
            if tuple(src.shape) != tuple(t.shape) or src.dtype != t.dtype:
                raise UsageError(f"{name}: the value is {tuple(src.shape)} {src.dtype}, the module's tensor "
                                 f"{tuple(t.shape)} {t.dtype}")
            if zero_copy and t.device.type == "cpu" and a.flags.writeable and a.flags.c_contiguous:
                t.set_(src)  # the same Parameter/buffer object, now over the verified replica
                shared += 1
                continue
            t.copy_(src)
            back = to_numpy(t)  # read the device's copy back
            if array_digest(back) != array_digest(a):
                raise IntegrityError(f"{name}: the copy on {t.device} differs from the verified value")
    return shared


def sync_module(module: torch.nn.Module, *, devices: Any = None, mesh: Any = None, values: Any = None,
                **sync_kwargs: Any) -> collective.SyncResult:
    """Make the module's parameters and buffers rank 0's, in place, on every rank.

    Every rank calls it (SPMD). ``devices`` defaults to the module's device; the other keyword
    arguments go to ``collective.sync`` (``rank``, ``world_size``, ``chief``, ``token``,
    ``timeouts``...). Returns the ``SyncResult``.

    A module whose state holds DTensors (FSDP2), or a ``mesh`` given, is synced by shards: each
    rank receives only its local shards (``Shard(0)``; ``Replicate`` and plain tensors whole).
    Rank 0 then passes ``values``: the whole state (name -> tensor or array, the names of
    ``state_dict()``, or a model path), since its own DTensors hold only its shard; ``mesh``, if
    given, must be the DTensors' mesh of every rank (1-D, or 2-D with one sharding dimension:
    HSDP, where each replica group's ranks receive the model's shards between them).
    """
    if mesh is not None or any(_is_dtensor(t) for t in module.state_dict(keep_vars=True).values()):
        return _sync_sharded(module, mesh, values, devices, sync_kwargs)
    if values is not None:
        raise UsageError("values= is for sharded modules (DTensors, or mesh=); a plain module serves its own state")
    values = state_arrays(module)
    result = collective.sync(values, devices=devices if devices is not None else module_device(module), **sync_kwargs)
    del values  # the module's old storage goes once its tensors take the replicas
    load_arrays(module, result.arrays(0))
    release_freed_memory()
    return result


def check_module(module: torch.nn.Module, **check_kwargs: Any) -> str:
    """``collective.check`` over the module's ``state_dict()`` (parameters and buffers, by
    name): every rank calls it at the same step. CPU tensors are hashed in place; others are
    copied to the CPU first. Keyword arguments go to ``collective.check`` (``step``, ``group``,
    ``exchange``, ``timeout``). Returns the digest every rank shares; raises ``DivergenceError``
    on every rank when they differ."""
    return collective.check(state_arrays(module), **check_kwargs)


def _is_dtensor(t: torch.Tensor) -> bool:
    # Not imported here: importing torch.distributed.tensor pulls in sympy and mpmath (about
    # 40 MiB that would stay in every process), and no DTensor exists before its module is.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _placements(module: torch.nn.Module, mesh: Any) -> tuple[dict[str, torch.Tensor], dict[str, str], list, Any, Any]:
    """Each state tensor's local tensor (the DTensor's shard, or the tensor) and placement
    (``dim0`` or ``all``), the declaration of the whole state, the DTensors' mesh (``mesh`` or
    theirs) and the mesh dimension that shards (None: none does). UsageError for a placement a
    plan cannot carry (another tensor dimension, a partial sum, two sharding mesh dimensions,
    DTensors on different meshes)."""
    from torch.distributed.tensor import Replicate, Shard

    from collective.model import VariableSpec

    local, request, specs, dims = {}, {}, [], set()
    for name, t in module.state_dict(keep_vars=True).items():
        shape, placement = tuple(t.shape), "all"  # a DTensor's shape is the whole tensor's
        if _is_dtensor(t):
            if mesh is None:
                mesh = t.device_mesh
            elif t.device_mesh != mesh:
                raise UsageError(f"{name}: its DTensor lives on mesh {t.device_mesh}, not {mesh}; sync_module takes "
                                 f"one mesh of every rank")
            sharding = [i for i, p in enumerate(t.placements) if isinstance(p, Shard)]
            if (any(not isinstance(p, (Shard, Replicate)) or (isinstance(p, Shard) and p.dim != 0) for p in t.placements)
                    or len(sharding) > 1):
                raise UsageError(f"{name}: placements {tuple(t.placements)!r} cannot be synced; use Shard(0) on at "
                                 f"most one mesh dimension and Replicate on the others (FSDP2, HSDP)")
            if sharding:
                placement = "dim0"
                dims.add(sharding[0])
            t = t.to_local()
        local[name], request[name] = t, placement
        specs.append(VariableSpec(name, shape, dtypes.wire(to_numpy(torch.empty(0, dtype=t.dtype)).dtype)))
    if len(dims) > 1:
        raise UsageError(f"the module's DTensors shard over mesh dimensions {sorted(dims)}; sync_module takes one")
    return local, request, specs, mesh, (dims.pop() if dims else None)


def _shard_groups(mesh: Any, dim: Any, request: dict[str, str]):
    """The request for ``collective.sync``: rank ``r`` holds the shard of its coordinate on the
    mesh's sharding dimension ``dim`` (``collective.shards.Groups``; the plain request when that
    is rank ``r``'s own shard, a 1-D mesh in rank order). Over a 2-D mesh (HSDP) the ranks of one
    replica group hold the whole model between them. UsageError for a mesh that is not every
    rank once."""
    from collective.shards import Groups

    if mesh is None:
        return request
    grid = mesh.mesh.cpu().numpy()
    if sorted(grid.reshape(-1).tolist()) != list(range(grid.size)):
        raise UsageError(f"mesh {mesh} does not hold every rank 0..{grid.size - 1} once")
    shard_of = [0] * grid.size
    for coordinate, rank in np.ndenumerate(grid):
        shard_of[int(rank)] = coordinate[dim] if dim is not None else 0
    return request if shard_of == list(range(grid.size)) else Groups(request, tuple(shard_of))


class _Declared:
    """A rank's declaration of the whole state (names, whole shapes, dtypes): never filled."""

    def __init__(self, specs: list) -> None:
        self._specs, self.description = specs, f"the module's state ({len(specs)} tensors)"

    def specs(self) -> list:
        return list(self._specs)

    def fill(self, spec, out) -> None:
        raise UsageError("a declared state has no values: rank 0 passes values=")


def _sync_sharded(module: torch.nn.Module, mesh: Any, values: Any, devices: Any, kwargs: dict) -> collective.SyncResult:
    from collective._api import as_source
    from collective.plan import declaration_differences, declared

    local, request, specs, mesh, dim = _placements(module, mesh)
    if values is not None:
        if isinstance(values, Mapping):
            values = {n: to_numpy(v) if isinstance(v, torch.Tensor) else v for n, v in values.items()}
        source = as_source(values)
        diffs = declaration_differences(source.specs(), declared(specs))
        if diffs:
            raise UsageError(f"values= differ from the module's state ({len(diffs)} difference(s)): "
                             + "; ".join(diffs[:10]))
    else:
        source = _Declared(specs)
    result = collective.sync(source, devices=devices if devices is not None else module_device(module),
                             shards=_shard_groups(mesh, dim, request), **kwargs)
    if mesh is not None and (mesh.size(), mesh.get_rank()) != (result.world_size, result.rank):
        raise UsageError(f"the mesh has {mesh.size()} ranks and puts this one at rank {mesh.get_rank()}; "
                         f"collective says rank {result.rank} of {result.world_size}: the mesh's ranks must be "
                         f"the training ranks")
    arrays = result.arrays(0)
    for name, t in local.items():
        if tuple(t.shape) != arrays[name].shape:
            raise UsageError(f"{name}: this rank's local shard is {tuple(t.shape)}, its rows of rank 0's value "
                             f"{arrays[name].shape} (torch.chunk's rule over the shards)")
    _write(local, arrays, zero_copy=False)  # into each DTensor's own local tensor, read back and checked
    del source, values, arrays
    release_freed_memory()
    return result


def as_tensors(state: Any) -> Any:
    """A fetched state (``collective.fetch``) with every numpy array a CPU tensor over the same
    memory (``torch.from_numpy``: zero copy); dicts, lists, tuples and other leaves as they are."""
    if isinstance(state, np.ndarray):
        return from_numpy(state)
    if isinstance(state, Mapping):
        return {k: as_tensors(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        items = [as_tensors(v) for v in state]
        return tuple(items) if isinstance(state, tuple) else items
    return state


def receive_targets(module: torch.nn.Module, prefix: str = "") -> dict[str, np.ndarray]:
    """``collective.fetch(into=...)`` targets for ``module``'s own CPU tensors: name (with
    ``prefix``, e.g. ``"model/"`` when the module's state was published under ``"model"``) ->
    a numpy view of the tensor's memory, so the fetch writes the values straight into the
    module (no second copy of the state). Only contiguous CPU tensors of numpy-known dtypes are
    listed; the others arrive in the fetch's own arrays (load them with ``load_state``)."""
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if t.device.type == "cpu" and t.is_contiguous() and not _is_dtensor(t):
            out[prefix + name] = to_numpy(t)
    return out


def load_state(module: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, *,
               state: Mapping, model_key: str = "model", optimizer_key: str = "optimizer") -> None:
    """Load a fetched state into ``module`` and / or ``optimizer``, in place.

    ``state`` is what ``collective.fetch`` returned for a published ``module.state_dict()``
    (with only ``module``), an ``optimizer.state_dict()`` (with only ``optimizer``), or a dict
    holding both under ``model_key`` and ``optimizer_key`` (``{"model": ..., "optimizer": ...}``;
    required when both are given). The module's CPU tensors take the fetched arrays' memory
    (``load_arrays``: zero copy, the same Parameter objects, so an optimizer built on them keeps
    working); the optimizer loads its state through ``load_state_dict`` from zero-copy tensors.
    """
    if module is None and optimizer is None:
        raise UsageError("load_state needs a module, an optimizer or both")
    both = module is not None and optimizer is not None
    for obj, key in ((module, model_key), (optimizer, optimizer_key)):
        if obj is None:
            continue
        part = state.get(key) if (both or key in state and _is_nested(state)) else state
        if not isinstance(part, Mapping):
            raise UsageError(f"the fetched state has no {key!r} entry for the {type(obj).__name__}; "
                             f"publish {{{model_key!r}: model.state_dict(), {optimizer_key!r}: optimizer.state_dict()}}")
        if obj is module:
            load_arrays(module, part)
        else:
            optimizer.load_state_dict(as_tensors(part))


def _is_nested(state: Mapping) -> bool:
    """Whether ``state`` holds several states by key rather than being one module's tensors."""
    return any(isinstance(v, Mapping) for v in state.values())


# Every-step updates (issue 38): a trainer publishes its module each step, followers apply each
# step into their own module's tensors, in place, verified.

MODEL_KEY, OPTIMIZER_KEY = "model", "optimizer"


def _distinct(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict(keep_vars=True)`` with a tensor met under several names (tied
    weights: ``lm_head.weight`` is ``model.embed_tokens.weight``) kept under its first name
    only, so it travels and is written once."""
    seen: set[int] = set()
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def module_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """What ``publish_module`` and ``Publication.update`` take for ``module``: its parameters and
    persistent buffers as numpy arrays (views of CPU tensors; bf16 as ``ml_dtypes.bfloat16``,
    the same bits), a tied tensor once under its first name. With ``optimizer``:
    ``{"model": those, "optimizer": optimizer.state_dict()}`` (the optimizer's state tensors and
    its hyper-parameters as JSON). The publication copies it; the caller may train on at once.
    """
    arrays = {name: to_numpy(t) for name, t in _distinct(module).items()}
    if optimizer is None:
        return arrays
    return {MODEL_KEY: arrays, OPTIMIZER_KEY: optimizer.state_dict()}


def publish_module(module: torch.nn.Module, *, step: int, optimizer: torch.optim.Optimizer | None = None,
                   **publish_kwargs: Any):
    """``collective.publish`` of ``module_state(module, optimizer)`` at ``step``, copied (so
    ``update`` works and the caller may train on at once). Each later step::

        pub.update(collective.torch.module_state(model), step=step)

    The other keyword arguments go to ``collective.publish`` (``token``, ``bind``, ``name``...)."""
    if publish_kwargs.setdefault("copy", True) is not True:
        raise UsageError("publish_module copies the module's state (copy=True): update() needs the copy")
    return collective.publish(module_state(module, optimizer), step=step, **publish_kwargs)


class ModuleSubscription:
    """A ``collective.subscribe`` Subscription whose arrays are a module's own tensors.

    ``apply()`` writes the next verified step into the module's parameters and buffers in place
    (the same ``Parameter`` objects, the same memory: an optimizer or a generation loop holding
    them sees the new values) and, with an optimizer, loads the step's optimizer state (its
    tensors are the subscription's arrays, so loading copies nothing) and hyper-parameters.
    ``step``, ``manifest_digest``, ``state``, ``stats``, ``poll`` and the rest are the
    subscription's (``subscription``); ``close()`` ends it; a context manager.
    """

    def __init__(self, subscription: Any, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 copied: dict[str, torch.Tensor]) -> None:
        self.subscription, self.module, self.optimizer = subscription, module, optimizer
        self._copied = copied  # tensors the arrays cannot be (not CPU, not contiguous): copied into

    def __getattr__(self, name: str) -> Any:
        return getattr(self.subscription, name)

    def apply(self, timeout: float = 0.0) -> int | None:
        """Apply the waiting step (``Subscription.apply``) into the module (and optimizer);
        return the new step, or None when none arrived within ``timeout`` s."""
        step = self.subscription.apply(timeout)
        if step is not None:
            self._load()
        return step

    def _model_part(self) -> Mapping:
        state = self.subscription.state
        return state[MODEL_KEY] if self.optimizer is not None else state

    def _check(self, targets: Mapping[str, np.ndarray]) -> None:
        """After the first fetch: the publication's tensors are the module's, and every target
        array received its tensor in place."""
        held = self._model_part()
        names = set(_distinct(self.module))
        extra = [n for n, v in held.items() if isinstance(v, np.ndarray) and n not in names]
        if extra:
            raise UsageError(f"the publication holds {len(extra)} tensor(s) the module has not: "
                             f"{', '.join(sorted(extra)[:5])}")
        prefix = MODEL_KEY + "/" if self.optimizer is not None else ""
        for name, a in targets.items():
            got = held.get(name.removeprefix(prefix))
            if got is None or not np.shares_memory(got, a):
                raise IntegrityError(f"{name}: the subscription did not receive it into the module's tensor")

    def _load(self) -> None:
        if self._copied:
            _write(self._copied, self._model_part(), zero_copy=False)
        if self.optimizer is not None:
            state = self.subscription.state.get(OPTIMIZER_KEY)
            if not isinstance(state, Mapping):
                raise UsageError(f"the publication has no {OPTIMIZER_KEY!r} state for the optimizer; the "
                                 f"trainer publishes it with publish_module(..., optimizer=...)")
            self.optimizer.load_state_dict(as_tensors(state))  # views of the arrays: nothing copied

    def close(self) -> None:
        self.subscription.close()

    def __enter__(self) -> ModuleSubscription:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ModuleSubscription({type(self.module).__name__}, {self.subscription!r})"


def subscribe(module: torch.nn.Module, sources: Any, *, optimizer: torch.optim.Optimizer | None = None,
              **subscribe_kwargs: Any) -> ModuleSubscription:
    """Follow a ``publish_module`` publication into ``module``'s own tensors.

    ``collective.subscribe(sources, into=...)`` with the module's CPU tensors as the ``into``
    arrays (numpy views of their memory, ``receive_targets``): the current step is fetched,
    verified, straight into the parameters and buffers before this returns, and each
    ``apply()`` writes the next step there in place, verified. A tensor that cannot be viewed
    (on a device, not contiguous) is copied into after each step, read back and checked. With
    ``optimizer`` the publication must hold ``{"model": ..., "optimizer": ...}`` (the trainer's
    ``publish_module(..., optimizer=...)``) and the optimizer is loaded from it after each
    step. The other keyword arguments go to ``collective.subscribe`` (``token``, ``timeout``,
    ``stall_timeout``, ``auto``: steps applied as they arrive, under ``lock``, for a module all
    of whose tensors are CPU views and no optimizer). UsageError when the publication's tensors
    are not the module's.
    """
    prefix = MODEL_KEY + "/" if optimizer is not None else ""
    targets, copied = {}, {}
    for name, t in _distinct(module).items():
        if t.device.type == "cpu" and t.is_contiguous() and not _is_dtensor(t):
            targets[prefix + name] = to_numpy(t)
        else:
            copied[name] = t
    if subscribe_kwargs.get("auto") and (copied or optimizer is not None):
        raise UsageError("auto=True applies each step on the subscription's thread, where neither an optimizer "
                         f"nor tensors off the CPU ({', '.join(list(copied)[:3]) or 'none'}) are loaded: call apply()")
    sub = collective.subscribe(sources, into=targets, **subscribe_kwargs)
    try:
        wrapped = ModuleSubscription(sub, module, optimizer, copied)
        wrapped._check(targets)
        wrapped._load()
    except BaseException:
        sub.close()
        raise
    return wrapped
