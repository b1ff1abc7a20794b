"""collective as a vLLM weight-transfer engine: each training step reaches a running ``vllm.LLM``
as the bytes that changed, verified, and is loaded through vLLM's own checkpoint loader.

Installed with collective, the ``vllm.general_plugins`` entry point (``register``) adds the
backend ``"collective"`` to vLLM's registries in every vLLM process (the engine core runs in its
own process by default), so::

    llm = LLM(model=checkpoint_dir, weight_transfer_config={"backend": "collective"},
              worker_extension_cls="collective.vllm.CollectiveWorkerExtension")   # the extension: optional
    trainer = WeightTransferTrainerFactory.trainer_init(
        CollectiveTrainerInitInfo(rank=0), client=LLMClient(llm), source=ModuleSource(model))
    for step in range(1, steps + 1):
        train_one_step(model)
        trainer.send_weights(step)    # publish step, engines take its delta, verify, load; returns after
    llm.collective_rpc("collective_weights")   # [{"step": .., "manifest_digest": .., ...}] per worker

Trainer side (``CollectiveTrainerWeightTransferEngine``): ``trainer_init`` publishes the source's
tensors (``collective.publish``, ``copy=True``) under the names ``named_parameters`` gives them,
which are the checkpoint's names, and asks every engine to subscribe. ``send_weights(step)``
gives the publication the new values (``Publication.update``: one copy, the delta made off the
training thread), waits until the step is served, then drives vLLM's round
(``start_weight_update``, ``update_weights({"step", "manifest_digest"})``,
``finish_weight_update(weight_version="step N <digest>")``). It returns when every engine has
loaded the step, or raises what an engine raised.

Engine side (``CollectiveWeightTransferEngine``): ``init_transfer_engine`` subscribes
(``collective.subscribe``: the current step fetched in full and verified, then each new step's
delta received and checked in the background, off the serving path). ``update_weights`` applies
steps until it holds the one asked for (a newer one if the trainer went on), checks the
manifest digest it holds against the trainer's, and loads what changed into the model.

Why through the checkpoint loader: on CPU vLLM repacks every linear weight after loading (the
module's parameters are then empty), and fuses q/k/v and gate/up into one module, so a tensor
cannot be patched where it lies. The subscription's arrays are the checkpoint-named copy; a step
reloads, with ``initialize_layerwise_reload`` / ``model.load_weights`` /
``finalize_layerwise_reload``, every tensor of each decoder layer (vLLM's ``layerwise_groups``:
the embeddings, each indexed layer, the tail) that holds a changed tensor, so a fused module
always gets all its parts in the same update; untouched layers keep their kernel tensors. The
first update after ``init_transfer_engine`` loads every tensor: the model holds the checkpoint it
started from, which need not be the trainer's state.

What is verified: the subscription's arrays equal the trainer's step bit for bit (chunk and
manifest digests, ``collective.subscribe``); what the model made of them after repacking is
vLLM's (the end-to-end check is greedy generation, tests/vllm). The engine keeps one copy of the
checkpoint (the subscription's arrays) beside the model's own.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferInitRequest,
    WeightTransferUpdateInfo,
    WeightTransferUpdateRequest,
    layerwise_groups,
    materialize_full_tensor,
)
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

import collective
from collective.digest import array_digest
from collective.errors import DeadlineError, IntegrityError, UsageError
from collective.tensors import from_numpy

__all__ = ["BACKEND", "register", "CollectiveInitInfo", "CollectiveUpdateInfo",
           "CollectiveWeightTransferEngine", "CollectiveTrainerInitInfo",
           "CollectiveTrainerWeightTransferEngine", "CollectiveWorkerExtension", "LLMClient",
           "checkpoint_state", "reload_names", "weight_version"]

log = logging.getLogger(__name__)

BACKEND = "collective"
"""The name of the backend in ``weight_transfer_config={"backend": ...}``."""


def register() -> None:
    """The ``vllm.general_plugins`` entry point: add the engine and the trainer engine to vLLM's
    registries (lazily, by module path). vLLM calls it once in each of its processes; a second
    call is a no-op."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, cls in ((WeightTransferEngineFactory, "CollectiveWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "CollectiveTrainerWeightTransferEngine")):
        try:
            factory.register_engine(BACKEND, __name__, cls)
        except ValueError:  # already registered in this process
            pass


def weight_version(step: int, manifest_digest: str) -> str:
    """The weight version the trainer sets after a step (``LLM.get_weight_version()``)."""
    return f"step {step} {manifest_digest}"


# ---- engine side --------------------------------------------------------------------------


@dataclass
class CollectiveInitInfo(WeightTransferInitInfo):
    """What ``init_weight_transfer_engine`` carries: where the publication is.

    ``sources``: ``"host:port"`` or a list (the publication and any holder of its steps).
    ``token``: the publication's token; None reads ``COLLECTIVE_TOKEN`` in the engine's
    environment (which keeps it off vLLM's control plane). ``timeout``: for the first, full
    fetch; ``stall_timeout``: a holder silent that long is dropped."""

    sources: list[str] | str
    token: str | None = None
    timeout: float = 300.0
    stall_timeout: float = 30.0


@dataclass
class CollectiveUpdateInfo(WeightTransferUpdateInfo):
    """What ``update_weights`` carries: the step to hold and, when the trainer knows it, that
    step's manifest digest (a different one is an IntegrityError). ``timeout``: how long to wait
    for the step to arrive."""

    step: int
    manifest_digest: str | None = None
    timeout: float = 300.0


def reload_names(names: list[str], changed: set[str]) -> list[str]:
    """The tensors to load for a step that changed ``changed``: every tensor of each of vLLM's
    layer groups (``layerwise_groups``: the embeddings, each decoder layer, the tail) that holds
    a changed one, in ``names`` order. A group is the unit because vLLM fuses tensors within a
    layer (q/k/v, gate/up, experts) and reprocesses a module only once all its parts arrived."""
    out: list[str] = []
    for group in layerwise_groups(names):
        if any(n in changed for n in group):
            out.extend(group)
    order = {n: i for i, n in enumerate(names)}
    return sorted(out, key=order.__getitem__)


def load_checkpoint_tensors(model: torch.nn.Module, model_config: Any,
                            weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
    """Load checkpoint-named tensors into a running model through vLLM's layerwise reload (the
    CPU path: modules are restored, loaded, then repacked; modules not loaded keep their
    kernel tensors). Returns the parameter names ``load_weights`` reports."""
    initialize_layerwise_reload(model)
    try:
        loaded = model.load_weights(weights)
    finally:
        finalize_layerwise_reload(model, model_config)
    return set(loaded or ())


def _tensors(state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {n: a for n, a in state.items() if isinstance(a, np.ndarray)}


class CollectiveWeightTransferEngine(WeightTransferEngine[CollectiveInitInfo, CollectiveUpdateInfo]):
    """vLLM's engine side (one per worker): a ``collective.subscribe`` to the trainer's
    publication, whose verified steps are loaded into the worker's model."""

    init_info_cls = CollectiveInitInfo
    update_info_cls = CollectiveUpdateInfo
    supports_draft_weight_update = False  # one subscription feeds one model

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._sub = None
        self._loaded: dict[str, str] | None = None  # name -> digest the model was last loaded with
        self._report: dict[str, Any] = {"step": None, "manifest_digest": None}

    def init_transfer_engine(self, init_info: CollectiveInitInfo) -> None:
        """Subscribe (blocks until the publication's current step is held, verified)."""
        self.shutdown()
        started = time.perf_counter()
        self._sub = collective.subscribe(init_info.sources, token=init_info.token,
                                         timeout=init_info.timeout, stall_timeout=init_info.stall_timeout)
        self._loaded = None  # the model holds its start checkpoint, not a step: load it all next
        log.info("collective engine: subscribed to %s at step %d in %.2f s", init_info.sources,
                 self._sub.step, time.perf_counter() - started)

    def start_weight_update(self) -> None:
        self._subscription()  # a round before init_weight_transfer_engine fails here, by name

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a host
        # without an accelerator (vLLM's CPU build); loading here is synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: CollectiveUpdateInfo) -> None:
        """Hold ``update_info.step`` (apply the steps received in the background until then),
        check its manifest digest, and load what changed since the last load into the model."""
        sub = self._subscription()
        started = time.perf_counter()
        _follow(sub, update_info.step, update_info.timeout)
        if sub.step == update_info.step and update_info.manifest_digest not in (None, sub.manifest_digest):
            raise IntegrityError(
                f"collective engine: step {sub.step} here has manifest digest {sub.manifest_digest}, "
                f"the trainer's has {update_info.manifest_digest}; nothing loaded", culprit="trainer")
        if sub.step > update_info.step:
            log.info("collective engine: asked for step %d, holding the newer step %d", update_info.step, sub.step)
        applied = time.perf_counter()
        tensors = _tensors(sub.state)
        digests = {n: array_digest(a) for n, a in tensors.items()}
        changed = set(digests) if self._loaded is None else {n for n, d in digests.items() if self._loaded.get(n) != d}
        names = reload_names(list(tensors), changed)
        self._loaded = None  # until the load completes: a failed one leaves the model unknown, reload all next
        load_checkpoint_tensors(self.model, self.model_config, ((n, from_numpy(tensors[n])) for n in names))
        self._loaded = digests
        self._report = {"step": sub.step, "manifest_digest": sub.manifest_digest, "pid": os.getpid(),
                        "changed_tensors": len(changed), "loaded_tensors": len(names),
                        "tensors": len(tensors), "apply_seconds": applied - started,
                        "load_seconds": time.perf_counter() - applied, "last": dict(sub.stats or {})}
        log.info("collective engine: holding step %d (manifest %s): %d of %d tensors changed, %d loaded",
                 sub.step, sub.manifest_digest, len(changed), len(tensors), len(names))

    def finish_weight_update(self) -> None:
        pass  # receive_weights loaded and finalized the step already

    def held(self) -> dict[str, Any]:
        """The step and manifest digest the model was last loaded with (None before the first
        update), this process's id, and what that update cost."""
        return dict(self._report)

    def shutdown(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            sub.close()

    def _subscription(self):
        if self._sub is None:
            raise UsageError("collective engine: no subscription; call init_weight_transfer_engine "
                             "with the publication's sources first")
        return self._sub


def _follow(sub, step: int, timeout: float) -> None:
    """Apply the steps ``sub`` receives until it holds ``step`` or a later one."""
    deadline = time.monotonic() + timeout
    while sub.step < step:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineError(f"collective engine: step {step} did not arrive within {timeout:g} s; "
                                f"holding step {sub.step}", phase="update")
        sub.apply(timeout=left)


class CollectiveWorkerExtension:
    """``LLM(..., worker_extension_cls="collective.vllm.CollectiveWorkerExtension")`` adds
    ``collective_weights`` to vLLM's workers: ``llm.collective_rpc("collective_weights")`` gives
    each worker's ``held()``."""

    def collective_weights(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, CollectiveWeightTransferEngine):
            raise UsageError("this worker's weight transfer backend is not 'collective' "
                             "(weight_transfer_config={'backend': 'collective'})")
        return engine.held()


# ---- trainer side -------------------------------------------------------------------------


@dataclass
class CollectiveTrainerInitInfo(TrainerInitInfo):
    """The trainer's side: the first step's number, where to serve (``bind``; ``advertise``:
    the address engines dial, default the publication's), the publication's name in errors,
    the token (sent to the engines through vLLM's control plane; None: the trainer and the
    engines read COLLECTIVE_TOKEN from their environments, and no token crosses vLLM), and the
    engines' deadline for their first, full fetch (``timeout``)."""

    backend: ClassVar[str] = BACKEND

    step: int = 0
    bind: str = "127.0.0.1:0"
    advertise: str | None = None
    token: str | None = None
    name: str | None = None
    timeout: float = 300.0


def checkpoint_state(source: WeightSource) -> dict[str, torch.Tensor]:
    """The source's tensors under their names, on the CPU: what is published. Iterates the
    source (a collective on a sharded model: every rank calls it)."""
    out = {}
    for name, tensor in source:
        if tensor is None:
            continue
        out[name] = materialize_full_tensor(tensor).detach().to("cpu")
    return out


class CollectiveTrainerWeightTransferEngine(TrainerWeightTransferEngine[CollectiveTrainerInitInfo]):
    """vLLM's trainer side: a ``collective.publish`` of the source's tensors, updated each step."""

    init_info_cls = CollectiveTrainerInitInfo

    def __init__(self, *, client, source: WeightSource | None = None, is_sender: bool = True) -> None:
        if source is None:
            raise UsageError("the collective trainer engine publishes a WeightSource: pass "
                             "source=ModuleSource(model) (vllm.distributed.weight_transfer.base)")
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.publication = None
        self.step: int | None = None

    @classmethod
    def trainer_init(cls, init_info: CollectiveTrainerInitInfo, *, client, source: WeightSource | None = None):
        """Publish the source at ``init_info.step`` and have every engine subscribe (returns once
        they hold it). Every rank calls it; rank 0 publishes."""
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.step = init_info.step
        state = checkpoint_state(source)
        if not engine.is_sender:
            return engine
        engine.publication = collective.publish(state, step=init_info.step, copy=True, token=init_info.token,
                                                bind=init_info.bind, name=init_info.name)
        info: dict[str, Any] = {"sources": [init_info.advertise or engine.publication.address],
                                "timeout": init_info.timeout}
        if init_info.token is not None:
            info["token"] = init_info.token
        try:
            client.init_weight_transfer_engine(info)
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def send_weights(self, step: int | None = None) -> dict[str, Any] | None:
        """Publish the source's current values as ``step`` (default: the last step + 1) and drive
        one update round; returns ``{"step", "manifest_digest", "publish_seconds",
        "update_seconds"}`` on the sender, None elsewhere. Blocks until every engine loaded it."""
        state = checkpoint_state(self.source)
        if not self.is_sender:
            return None
        step = self.step + 1 if step is None else step
        if step <= self.step:
            raise UsageError(f"send_weights(step={step}): steps strictly increase; the last was {self.step}")
        started = time.perf_counter()
        self.publication.update(state, step=step)
        self.publication.wait()
        served = time.perf_counter()
        digest = self.publication.manifest_digest
        self.client.start_weight_update()
        self.client.update_weights({"step": step, "manifest_digest": digest})
        self.client.finish_weight_update(weight_version=weight_version(step, digest))
        self.step = step
        return {"step": step, "manifest_digest": digest, "publish_seconds": served - started,
                "update_seconds": time.perf_counter() - served}

    def shutdown(self) -> None:
        if self.publication is not None:
            pub, self.publication = self.publication, None
            pub.close()


class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` over an ``LLM`` of this process (whose own methods take
    request objects, not the protocol's dicts)."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
