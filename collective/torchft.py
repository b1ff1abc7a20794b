"""torchft recovery through verified snapshots: a ``CheckpointTransport`` on ``collective.publish``
and ``collective.fetch``.

::

    import collective.torchft
    manager = torchft.Manager(..., checkpoint_transport=collective.torchft.Transport(token=TOKEN))

torchft's ``Manager`` asks every replica group for ``metadata()`` at each quorum and hands the
healthy group's string to a recovering one (also at step 0, ``init_sync``). Here that string is
the holder's ``host:port``, never the token. ``send_checkpoint`` publishes the manager's state
dict at ``step`` (tensors as raw bytes with their chunk digests, non-tensor leaves as JSON, never
pickle); ``recv_checkpoint`` fetches it from the address, verifies every chunk against the
holder's plan and returns the nested state dict with CPU tensors (``torch.from_numpy``: the
received memory, no second copy). A state dict that holds anything but tensors and JSON values
is refused (``UsageError`` naming the key) before a byte moves.

Tensors are served in place (``copy=False``, torchft's own contract): torchft calls
``disallow_checkpoint()`` before it mutates the state again, and the publication closes there.
Pass ``copy=True`` to serve a private copy instead (the caller may then mutate at once, at the
cost of a second copy of the state).

This module imports torchft (and torch); ``import collective`` never does.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from datetime import timedelta
from typing import Any

from torchft.checkpointing.transport import CheckpointTransport

import collective
from collective import tensors
from collective.errors import AbortedError, ChiefUnreachableError, UsageError
from collective.model import quoted
from collective.torch import as_tensors

__all__ = ["Transport"]

log = logging.getLogger(__name__)

# One holder address, as metadata() gives it: host (a name, IPv4, or [IPv6]) and port.
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
# While the holder has not published yet (its quorum thread is a little behind ours), it refuses
# the fetch (nothing published there now) or its port is not listening yet: try again this
# often, within the recovery's timeout.
_RETRY_SECONDS = 0.1


def _seconds(timeout: float | timedelta) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def parse_metadata(metadata: str) -> list[str]:
    """The holder addresses in a metadata string (``host:port[,host:port...]``); anything else
    (torchft's HTTPTransport gives ``http://...``) is a one-line ``UsageError``."""
    sources = [s.strip() for s in str(metadata).split(",") if s.strip()]
    bad = [s for s in sources if not _ADDRESS.match(s)]
    if not sources or bad:
        raise UsageError(f"checkpoint metadata {quoted(metadata)} is not a collective holder address (host:port): "
                         "every replica group must use collective.torchft.Transport")
    return sources


def _on_cpu(state: Any) -> Any:
    """``state`` with every device tensor copied to the host (as torchft's HTTPTransport does);
    CPU tensors stay themselves, served in place."""
    if isinstance(state, dict):
        return {k: _on_cpu(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_on_cpu(v) for v in state)
    if tensors.is_tensor(state) and state.device.type != "cpu":
        return state.detach().cpu()
    return state


class Transport(CheckpointTransport[dict]):
    """torchft's checkpoint transport over ``collective.publish`` / ``collective.fetch``.

    ``token``: the cluster token every holder and fetcher share (None: none asked; only on a
    trusted network). ``timeout``: a fetch's whole deadline unless torchft passes its own;
    ``stall_timeout``: how long a holder may send nothing before it counts as lost. ``bind``:
    where this process serves its snapshot (``host:port``; port 0 picks one, once, at the first
    ``metadata()``, which starts listening there: torchft hands that address around before
    anything is published, and every later step is served at it, ``Publication.replace``).
    ``advertise``: the host name or address the other groups reach this one by (default: the
    bind host, or this machine's host name for a wildcard bind, as torchft's HTTPTransport
    does). ``copy``: serve a private copy (a sealed memfd a same-host fetcher maps). ``tls``:
    ``collective.TlsFiles`` for both sides (server-only or mutual TLS, as for a round).
    ``name``: what a recovering group's errors call this holder (``holder NAME at ADDR``),
    e.g. torchft's replica id; default ``host:pid``.
    """

    def __init__(self, *, token: str | None = None, timeout: float | timedelta = 300.0,
                 stall_timeout: float = 30.0, bind: str = "0.0.0.0:0", advertise: str | None = None,
                 copy: bool = False, tls: Any = None, name: str | None = None) -> None:
        port = bind.rpartition(":")[2]
        if not port.isdigit() or int(port) > 65535:
            raise UsageError(f"bind={bind!r} is not host:port (port 0: one chosen at the first metadata())")
        self._token, self._timeout, self._stall = token, _seconds(timeout), float(stall_timeout)
        self._bind, self._advertise, self._copy, self._tls = bind, advertise, copy, tls
        self._name = name
        self._lock = threading.Lock()  # torchft's quorum thread publishes; its main thread disallows
        self._publication: Any = None  # listening from the first metadata() until shutdown

    def metadata(self) -> str:
        """This process's holder address, fixed at the first call (it starts listening then)."""
        with self._lock:
            return self._listening().address

    def _listening(self):
        """(Lock held.) The publication, started the first time with nothing served (an empty
        state, withdrawn at once): its socket listens from then on, so the address torchft gave
        out stays this process's (a port chosen but not yet bound could be taken meanwhile)."""
        if self._publication is None:
            host = self._bind.rpartition(":")[0].strip("[]")
            advertised = self._advertise or host
            if advertised in ("", "0.0.0.0", "::"):
                advertised = socket.gethostname()  # what another host can dial, as publish does
            self._publication = collective.publish({}, step=0, token=self._token, bind=self._bind,
                                                   advertise=advertised, copy=self._copy, tls=self._tls,
                                                   name=self._name)
            self._publication.withdraw(0)
        return self._publication

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict, timeout: timedelta) -> None:
        """Publish ``state_dict`` at ``step`` at the metadata address (in place of an earlier
        one); returns once it is served, before any receiver is done."""
        with self._lock:
            self._listening().replace(_on_cpu(state_dict), step)

    def disallow_checkpoint(self) -> None:
        """torchft is about to mutate the state: stop serving it (the address stays)."""
        with self._lock:
            if self._publication is not None:
                self._publication.withdraw()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict:
        """Fetch the state at ``step`` from the holder(s) in ``metadata``, every chunk verified;
        a holder that sends other bytes, another step or no snapshot at all is a one-line
        ``CollectiveError`` naming it. Nothing received is ever unpickled or executed."""
        sources = parse_metadata(metadata)
        seconds = min(self._timeout, _seconds(timeout)) if timeout else self._timeout
        deadline = time.monotonic() + seconds
        while True:
            try:
                # The fetch's arena has its pages in place before the first byte, at about
                # the cost of the faster of huge and small pages (arena.new_arena).
                state = collective.fetch(sources, step=step, token=self._token,
                                         timeout=max(deadline - time.monotonic(), 0.1),
                                         stall_timeout=self._stall, tls=self._tls)
                break
            except (ChiefUnreachableError, AbortedError):
                # Only "nobody listens yet" or "nothing published there now": the holder's quorum
                # thread publishes a moment after it gave out its address. Any other refusal
                # (bytes, step, token, not collective's protocol) is final.
                if time.monotonic() + _RETRY_SECONDS >= deadline:
                    raise
                time.sleep(_RETRY_SECONDS)
        return as_tensors(state)

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._publication is not None:
            publication, self._publication = self._publication, None
            publication.close()
