"""``fetch``: a published state from one or several holders, striped, every chunk verified.

1. The holders are asked for their plans (GetPlan, in pieces, counted as they arrive, at most
   ``limits.MAX_SNAPSHOT_PLAN_BYTES``) in order, in waves of at most ``MAX_ACTIVE_HOLDERS``
   threads, until a wave has one that answered; the sources not asked are spares. A plan is checked before anything is allocated:
   ``validate_plan``, complete (no ``digests_follow``), not cut finer than the chunk floor
   (``limits.snapshot_chunking_refused``), its step (``Plan.model``), its size against
   ``max_bytes``, its skeleton variable's size. The holders of the requested step whose
   manifest digests agree are used together (those of one layout: the same chunks); holders
   that disagree fail the fetch, naming both sides (one of them lies, and digests alone cannot
   say which).
2. A holder on this host that offers its sealed copy (``publish(copy=True)``) is mapped instead,
   every chunk of the mapping checked against the plan. Otherwise the arena's chunks are cut
   into stripes, taken in turn by one thread per holder: each stripe is one data stream
   (``WorkerRef.resume_from`` .. ``stop_at``) received in place by a ``Receiver`` of that span
   (its pages put in place just before: the arena is committed a stripe at a time), so every
   chunk is checked against the plan's digest as it lands. A holder whose stream breaks, is
   silent for ``stall_timeout``, verifies no chunk for ``stall_timeout`` while another holder
   or a spare is left, or sends bytes that differ from its plan is dropped; what it had not
   delivered goes back to the queue for the others, and its thread goes on with a spare.
3. Every variable's bytes are checked against its own digest (the manifest's), the skeleton
   variable is decoded (JSON only) and the state rebuilt: tensor leaves are numpy views of the
   one received arena, or the caller's ``into`` arrays.
"""

from __future__ import annotations

import bisect
import collections
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from collective import dtypes
from collective import errors as E
from collective._proto import collective_pb2 as pb
from collective.arena import lazy_arena
from collective.config import parse_address
from collective.digest import bytes_digest, chunk_digests
from collective.limits import MAX_SNAPSHOT_PLAN_BYTES, snapshot_chunking_refused
from collective.plan import align, validate_plan
from collective.replicas import variable_view
from collective.sizes import format_bytes
from collective.snapshot import tree
from collective.snapshot.holder import HOLDER_SEP, MODEL_PREFIX, cluster_token
from collective.snapshot.stripes import (
    MAX_ACTIVE_HOLDERS,
    Holder,
    Striper,
    differing,
    layout_digest,
    one_line,
)
from collective.snapshot.versions import DELTA_LABEL
from collective.stream import differing_chunk, overlapping

log = logging.getLogger(__name__)

_REF = "fetch"  # who a fetch says it is (its worker id); under mutual TLS, its certificate's name


def _identity(tls) -> str:
    """The worker id a fetch presents: its certificate's common name under mutual TLS (the
    holder admits only a caller its certificate names), else ``fetch``."""
    if tls is None or not tls.mutual:
        return _REF
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(tls.read("cert"))
    except ValueError as exc:
        raise E.UsageError(f"tls cert {tls.cert or '(in memory)'}: not a PEM certificate ({exc})") from None
    names = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return str(names[0].value) if names else _REF


class Fetched(dict):
    """The fetched state (a dict, as published), with ``step``, ``manifest_digest``,
    ``total_bytes`` (the arena's) and ``stats``: holder address -> bytes it delivered, stripes,
    and why it was dropped (if it was); ``plan`` and ``arrays`` (every variable by its plan
    name, the skeleton's bytes too), for ``collective.subscribe``."""

    step: int
    manifest_digest: str
    total_bytes: int
    stats: dict
    plan: pb.Plan
    arrays: dict


def _sources(sources: str | Sequence[str]) -> list[str]:
    items = [sources] if isinstance(sources, str) else list(sources)
    out = [a.strip() for item in items for a in str(item).split(",") if a.strip()]
    if not out:
        raise E.UsageError("fetch needs at least one holder address (host:port)")
    for address in out:  # gRPC would take port 99999 as 34463 (mod 65536), no port as 443
        parse_address(address, what="holder address")
    return list(dict.fromkeys(out))


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 40


def plan_step(plan: pb.Plan) -> int:
    """The step a checked plan is of (``_check_plan``)."""
    return int(plan.model.removeprefix(MODEL_PREFIX).partition(HOLDER_SEP)[0].partition(DELTA_LABEL)[0])


def _check_plan(h: Holder, plan: pb.Plan, step: int | None, max_bytes: int, delta_from: int | None = None) -> None:
    """The plan of holder ``h`` is one a fetch can take: consistent, of ``step`` (any step for
    None; with ``delta_from``, that step's delta from it), not larger than ``max_bytes``, with
    a skeleton variable. Raises naming the holder."""
    if not plan.model.startswith(MODEL_PREFIX):
        raise E.ProtocolError(f"{h.name()} is not a publication (it serves {plan.model[:80]!r})")
    got, _, label = plan.model.removeprefix(MODEL_PREFIX).partition(HOLDER_SEP)
    h.named(label)
    want = (str(step) if step is not None else None, None if delta_from is None else f"{DELTA_LABEL}{delta_from}")
    number, sep, rest = got.partition(DELTA_LABEL)
    if not (number.isdigit() and len(number) < 20 and (not sep or rest.isdigit())):
        raise E.ProtocolError(f"{h.name()} publishes step {got[:40]!r}: not a step")
    if want[0] is not None and number != want[0] or (sep + rest or None) != want[1]:
        wanted = "the newest step" if step is None else f"step {step}"
        raise E.FetchError(f"{h.name()} publishes step {got[:40]}, not {wanted}"
                           + (f" as a delta from step {delta_from}" if delta_from is not None else ""))
    if plan.total_bytes > max_bytes:
        raise E.ResourceExhaustedError(f"{h.name()} publishes {format_bytes(plan.total_bytes)}, more than "
                                       f"max_bytes={format_bytes(max_bytes)}; refused before allocating")
    try:
        validate_plan(plan)
    except E.ProtocolError as exc:
        raise E.ProtocolError(f"{h.name()} sent a plan that does not hold together: {exc}") from None
    if plan.digests_follow:  # a publication's plan is complete: without digests no byte could be checked
        raise E.ProtocolError(f"{h.name()} sent a plan without its digests (digests_follow); a fetch takes "
                              f"only bytes its plan's digests cover")
    refused = snapshot_chunking_refused(plan.total_bytes, plan.chunk_bytes)
    if refused is not None:
        raise E.ProtocolError(f"{h.name()} sent a plan of {refused}; refused before allocating")
    last = plan.variables[-1] if plan.variables else None
    if last is None or last.name != tree.TREE or last.dtype != "|u1" or len(last.shape) != 1:
        raise E.ProtocolError(f"{h.name()} sent a plan without its structure variable {tree.TREE!r} (bytes, last)")
    if last.nbytes > tree.MAX_TREE_BYTES:
        raise E.ProtocolError(f"{h.name()} sent a plan whose structure takes {last.nbytes} bytes, more than "
                              f"{tree.MAX_TREE_BYTES}; refused before allocating")


def _ask(h: Holder, step: int | None, deadline: float, stall_timeout: float, max_bytes: int,
         ident: str, delta_from: int | None = None) -> E.CollectiveError | None:
    """Ask ``h`` for its plan (of ``step``'s delta from ``delta_from``, if given) and check it
    (``h.plan`` set); the error that left it out, or None."""
    try:
        # A holder that does not answer within the stall timeout is left out, not waited for.
        wait = max(0.1, min(deadline - time.monotonic(), stall_timeout))
        ref = pb.WorkerRef(worker_id=ident)
        if delta_from is not None:
            ref.delta_from = delta_from
        plan = h.link.get_plan(ref, wait, phase="fetch (asking for its manifest)", max_bytes=MAX_SNAPSHOT_PLAN_BYTES)
        _check_plan(h, plan, step, max_bytes, delta_from)
        h.plan = plan
    except E.CollectiveError as exc:
        return exc
    return None


def _ask_plans(holders: list[Holder], step: int | None, deadline: float, stall_timeout: float,
               max_bytes: int, ident: str, delta_from: int | None = None,
               active: int = MAX_ACTIVE_HOLDERS) -> tuple[list[Holder], list[Holder]]:
    """The holders of ``step`` (None: of the newest step any of them serves) that agree on its
    manifest, asked in order in waves of at most ``MAX_ACTIVE_HOLDERS`` (one thread each) until
    a wave has one that answered; and the spares, those not asked (asked when a holder is
    dropped). ``active``: at most that many holders used at once (1: the first that serves the
    step, the others spares)."""
    errors: dict[str, E.CollectiveError] = {}
    asked: list[Holder] = []
    answered: list[Holder] = []  # in the order they answered; a thread still asking is not in it

    def ask(h: Holder) -> None:
        exc = _ask(h, step, deadline, stall_timeout, max_bytes, ident, delta_from)
        if exc is not None:
            errors[h.address] = exc
        else:
            answered.append(h)

    while len(asked) < len(holders) and not answered:
        if time.monotonic() >= deadline:
            break
        wave = holders[len(asked) : len(asked) + active]
        threads = [threading.Thread(target=ask, args=(h,), name="fetch-plan", daemon=True) for h in wave]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, min(deadline - time.monotonic(), stall_timeout)) + 1.0)
        asked.extend(wave)
        for h in wave:
            if h.address in errors:
                h.close()  # left out: its channels go now, not at the end of the fetch
    spares = holders[len(asked) :]
    ready = [h for h in asked if h in answered]
    for h in asked:
        if h not in answered and h.address not in errors:
            errors[h.address] = E.DeadlineError(f"{h.name()} did not answer with its manifest in time")
    if not ready:
        if len(errors) == 1:
            raise next(iter(errors.values()))
        said = [one_line(e) for e in errors.values()]
        more = f"; and {len(said) - 5} more" if len(said) > 5 else ""
        raise E.FetchError(f"no holder serves {'any step' if step is None else f'step {step}'}: " + "; ".join(said[:5]) + more)
    if step is None:  # the newest step served; holders of older ones are spares no more
        step = max(plan_step(h.plan) for h in ready)
        for h in ready:
            if plan_step(h.plan) != step:
                log.info("fetch: %s serves step %d, not the newest (%d); left out", h.name(), plan_step(h.plan), step)
        ready = [h for h in ready if plan_step(h.plan) == step]
    for exc in errors.values():
        log.warning("fetch of step %d: %s; fetching from the other holders", step, one_line(exc))
    groups = collections.defaultdict(list)
    for h in ready:
        groups[h.plan.manifest_digest].append(h.name())
    if len(groups) > 1:
        sides = "; ".join(f"{', '.join(a)} publish manifest {d}" for d, a in groups.items())
        raise E.FetchError(f"holders disagree on the manifest of step {step}: {sides}; compare them "
                         f"(collective.check) before trusting any")
    best = _same_layout(ready)
    return best[:active], best[active:] + spares


def _same_layout(ready: list[Holder]) -> list[Holder]:
    """The most holders whose plans lay the state out alike (the first such group on a tie);
    the others, of the same manifest but other chunks, are left out with a warning (their
    stripes would be checked against another plan's chunk digests, and blamed wrongly)."""
    groups = collections.defaultdict(list)
    for h in ready:
        groups[layout_digest(h.plan)].append(h)
    best = max(groups.values(), key=len)
    for h in ready:
        if h not in best:
            log.warning("fetch: %s publishes the same manifest in other chunks (%d-byte chunks, %d bytes); "
                        "left out, striping over %d holder(s) of one layout", h.name(), h.plan.chunk_bytes,
                        h.plan.total_bytes, len(best))
    return best


class _Into:
    """Where each variable's bytes go when the caller gave ``into`` arrays: those arrays, or the
    fetch's own (the others, and the skeleton: one receive arena). A stripe that lies inside
    one variable is received straight into its array (``target``); any other stripe into a
    buffer of its holder's and copied out once verified, so the fetch holds the state once plus
    at most one such stripe per holder."""

    def __init__(self, plan: pb.Plan, into: Mapping[str, np.ndarray]) -> None:
        names = {v.name: v for v in plan.variables}
        self.targets: dict[str, np.ndarray] = {}
        for name, a in into.items():
            v = names.get(name)
            if v is None or name == tree.TREE:
                raise E.UsageError(f"into[{name!r}]: the snapshot has no tensor of that name")
            want = (tuple(v.shape), dtypes.from_wire(v.dtype))
            if not isinstance(a, np.ndarray) or (a.shape, a.dtype) != want:
                got = (a.shape, a.dtype) if isinstance(a, np.ndarray) else type(a).__name__
                raise E.UsageError(f"into[{name!r}] is {got}; the snapshot's tensor is {want[0]} {want[1]}")
            if not (a.flags.c_contiguous and a.flags.writeable):
                raise E.UsageError(f"into[{name!r}] must be a writable C-contiguous array")
            self.targets[name] = a
        self.plan = plan
        self.ends = [v.offset + v.nbytes for v in plan.variables]  # in arena order (validate_plan)
        self.flat = {name: a.reshape(-1).view(np.uint8) for name, a in self.targets.items()}
        # The other variables in one receive arena of the fetch's own (its memory committed as
        # their bytes are copied in), each aligned as in the plan's layout.
        rest = [v for v in plan.variables if v.name not in self.targets]
        own, pos = lazy_arena(sum(align(v.nbytes) for v in rest)), 0
        for v in rest:
            self.flat[v.name] = own[pos : pos + v.nbytes]
            pos += align(v.nbytes)

    def target(self, a: int, b: int) -> tuple[np.ndarray, int] | None:
        """The array and the arena offset it starts at, when bytes ``a..b`` lie inside one
        variable (no padding, no other variable): the stripe is received there, in place."""
        i = bisect.bisect_right(self.ends, a)  # the first variable that ends past ``a``
        v = self.plan.variables[i] if i < len(self.ends) else None
        if v is None or not v.offset <= a < b <= v.offset + v.nbytes:
            return None
        return self.flat[v.name], v.offset

    def __call__(self, buf: np.ndarray, base: int, a: int, b: int) -> None:
        for v in overlapping(self.plan, a, b):
            dst = self.flat[v.name]
            if dst is buf:  # received in place (``target``)
                continue
            lo, hi = max(a, v.offset), min(b, v.offset + v.nbytes)
            dst[lo - v.offset : hi - v.offset] = buf[lo - base : hi - base]

    def arrays(self) -> dict[str, np.ndarray]:
        return {v.name: self.targets.get(v.name, variable_view(self.flat[v.name], v, v.offset)) for v in self.plan.variables}


def _check_variables(plan: pb.Plan, arrays: dict[str, np.ndarray], sender: str) -> None:
    """Every variable's bytes against its own digest, the manifest's: the chunk digests that
    checked the stream are the holder's word too, and a plan whose chunk digests cover other
    bytes than its variables' digests (a manifest copied from an honest holder over forged
    chunks) would otherwise hand out bytes that no trusted digest covered."""
    for v in plan.variables:
        if not v.nbytes:
            continue
        got = bytes_digest(memoryview(np.ascontiguousarray(arrays[v.name]).reshape(-1).view(np.uint8)))
        if got != v.digest:
            raise E.IntegrityError(f"{sender}: the bytes of {v.name!r} match the plan's chunk digests but not "
                                   f"its own digest {v.digest} (they hash to {got}): the plan does not hold "
                                   f"together; nothing returned")


def _attach(ready: list[Holder], plan: pb.Plan, ident: str) -> np.ndarray | None:
    """A same-host holder's sealed copy (``publish(copy=True)``), mapped copy-on-write and
    every chunk checked against the plan, or None (another host, no copy offered, or refused:
    then the stream). A mapping whose bytes differ names the holder and is not used."""
    from collective.transport import shm

    for h in ready:
        if not h.plan.shm_socket:
            continue
        arena = shm.attach(h.plan.shm_socket, h.plan.shm_secret, ident, "", plan.total_bytes, whose=h.name())
        if arena is None:
            continue
        differs = differing_chunk(plan, chunk_digests(arena, plan.chunk_bytes), plan.chunk_digests)
        if differs is not None:
            name = differing(plan, arena, 0, *differs)
            log.warning("fetch: %s shares a copy whose bytes of %r differ from its own plan; not used", h.name(), name)
            continue
        h.bytes, h.shared = plan.total_bytes, True
        return arena
    return None


def fetch(sources: str | Sequence[str], *, step: int, token: str | None = None, timeout: float = 300.0,
          stall_timeout: float = 30.0, into: Mapping[str, np.ndarray] | None = None,
          manifest: str | None = None, max_bytes: int | None = None, tls=None, shm: bool = True) -> Fetched:
    """The state published at ``step`` by the holders at ``sources``, every byte verified.

    :param sources: one ``host:port`` (or several, comma-separated) or a sequence of them. The
        holders of ``step`` whose manifests agree share the work, at most
        ``MAX_ACTIVE_HOLDERS`` (8) at once (the other sources are spares): the chunks are
        striped over them, and a holder lost (connection cut, process killed, silent for
        ``stall_timeout``, or no verified chunk for ``stall_timeout`` while another is left)
        or sending bytes that differ from its own plan is dropped and its share retaken from
        the others.
    :param step: the step wanted; a holder of another step is refused.
    :param token: the cluster token (default ``COLLECTIVE_TOKEN``).
    :param timeout: seconds for the whole fetch.
    :param stall_timeout: seconds a holder may send nothing (or no whole verified chunk, while
        another holder is left) before it counts as lost.
    :param into: name -> preallocated writable C-contiguous numpy array of that tensor's shape
        and dtype: those tensors are received into them (a stripe inside one tensor in place,
        checked as it lands; the rest in a buffer per holder, copied out once verified), so a
        recovering process need not hold the state twice. The result's leaves are those very
        arrays. A fetch that fails leaves them partly written.
    :param manifest: the manifest digest the state must have (from a source trusted more than
        the holders: what catches a holder that lies consistently in its own plan).
    :param max_bytes: the largest state accepted (default: this machine's memory); a plan that
        claims more is refused before anything is allocated. Memory is committed a stripe at a
        time as each is asked for: at most ``MAX_ACTIVE_HOLDERS`` x ``STRIPE_BYTES`` (8 x 64 MiB)
        ahead of the bytes that arrived.
    :return: a ``Fetched`` dict: the state as published, tensors as numpy arrays (views of one
        received arena, zero copy) and JSON values for the rest; ``.step``,
        ``.manifest_digest``, ``.total_bytes`` and ``.stats`` (per holder: bytes delivered,
        stripes, why it was dropped).
    :param tls: ``TlsFiles(ca=)`` to reach holders that serve TLS (``server_name=`` when their
        certificate names another host); with ``cert=`` and ``key=`` too, mutual TLS (the
        fetch presents itself under its certificate's common name).
    :param shm: map a same-host holder's sealed copy (``publish(copy=True)``) instead of
        receiving the stream, when it offers one (every chunk still checked); False: the stream.
    :raises FetchError: wrong step, holders disagreeing on the manifest, no holder left.
    :raises IntegrityError: a holder's bytes differ from its own plan and no other holder is left.
    :raises AuthError: a holder refused the token. ChiefUnreachableError: unreachable holder.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise E.UsageError(f"step must be an integer >= 0, not {step!r}")
    return fetch_step(sources, step=step, token=token, timeout=timeout, stall_timeout=stall_timeout, into=into,
                      manifest=manifest, max_bytes=max_bytes, tls=tls, shm=shm)


def fetch_step(sources: str | Sequence[str], *, step: int | None, delta_from: int | None = None,
               token: str | None = None, timeout: float = 300.0, stall_timeout: float = 30.0,
               into: Mapping[str, np.ndarray] | None = None, manifest: str | None = None,
               max_bytes: int | None = None, tls=None, shm: bool = True,
               active: int = MAX_ACTIVE_HOLDERS) -> Fetched:
    """``fetch``, also of the newest step the holders serve (``step`` None) or of a step's
    delta from ``delta_from`` (``collective.subscribe``: the state ``versions.delta_state``),
    from at most ``active`` holders at once (the others spares)."""
    from collective.transport.grpc import GrpcChiefLink

    if not (timeout > 0 and stall_timeout > 0):
        raise E.UsageError("timeout and stall_timeout must be > 0 seconds")
    addresses = _sources(sources)
    started = time.monotonic()
    deadline = started + timeout
    token = cluster_token(token)
    ident = _identity(tls)
    limit = max_bytes if max_bytes is not None else _memory_bytes()
    holders = [Holder(a, lambda a: GrpcChiefLink(a, token=token, name="holder", tls=tls)) for a in addresses]
    try:
        ready, spares = _ask_plans(holders, step, deadline, stall_timeout, limit, ident, delta_from, active)
        plan = ready[0].plan
        step = plan_step(plan)
        if manifest is not None and plan.manifest_digest != manifest:
            raise E.FetchError(f"{', '.join(h.name() for h in ready)} publish manifest {plan.manifest_digest} "
                             f"of step {step}, not the expected {manifest}")
        scatter = _Into(plan, into) if into is not None else None
        mapped = _attach(ready, plan, ident) if shm else None
        if mapped is not None:  # verified already; with ``into``, copied out
            arena = mapped
            if scatter is not None:
                scatter(mapped, 0, 0, plan.total_bytes)
        else:
            # Its pages committed a stripe at a time, as each is asked for (``warm``).
            arena = lazy_arena(plan.total_bytes) if scatter is None else None
            striper = Striper(plan, ready, spares, arena, scatter, stall_timeout, ident,
                               lambda h: _ask(h, step, deadline, stall_timeout, limit, ident, delta_from))
            striper.run(deadline, timeout)
            ready = striper.holders
        arrays = {v.name: variable_view(arena, v) for v in plan.variables} if scatter is None else scatter.arrays()
        sender = ", ".join(h.name() for h in ready)
        _check_variables(plan, arrays, sender)
        state = tree.unflatten(tree.decode(arrays[tree.TREE], step, sender), arrays, sender)
    finally:
        for h in holders:
            h.close()
    out = Fetched(state)
    out.step, out.manifest_digest, out.total_bytes = step, plan.manifest_digest, plan.total_bytes
    out.plan, out.arrays = plan, arrays
    out.stats = {h.address: {"bytes": h.bytes, "stripes": h.stripes, "dropped": h.dropped, "shared_memory": h.shared}
                 for h in ready}
    seconds = time.monotonic() - started
    log.info("fetched step %d (%s, manifest %s) in %.2f s: %s", step, format_bytes(plan.total_bytes),
             plan.manifest_digest, seconds,
             ", ".join(f"{a} {format_bytes(s['bytes'])}" + (f" (dropped: {s['dropped']})" if s["dropped"] else "")
                       for a, s in out.stats.items()))
    return out
