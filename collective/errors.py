"""The project's error family.

Every error message is a sentence that names the culprit (worker id and rank, the chief, a
variable, a file) and the rule it broke. ``exit_code`` is what a command-line entry point exits
with when the error reaches it: 2 for usage and input mistakes, 1 for run-time failures.

This is also the one error table of the wire: ``code`` is the gRPC status code name an error
travels under (over gRPC, the raw data path and MPI alike) and the class's name travels with it,
so a peer raises the very class that was raised (``wire_class``); a status without a name (from
gRPC itself, or from a foreign server) is read by its code alone (``FROM_CODE``).
"""

from __future__ import annotations


class CollectiveError(Exception):
    """Base class of every error this project raises on purpose.

    ``culprit``: who is at fault when one party is (a worker id, ``chief``), else None;
    ``phase``: the round's phase it happened in (``join``, ``receive``, ``ready``...), else
    None. Both travel with the error over every transport, so a worker's error names the
    culprit the chief named, and tests (and callers) read them instead of the message."""

    code = "ABORTED"
    exit_code = 1

    def __init__(self, *args: object, culprit: str | None = None, phase: str | None = None) -> None:
        super().__init__(*args)
        self.culprit = culprit
        self.phase = phase

    # A verdict on every member's part, not one member's fault the others suffer (an SPMD job
    # whose ranks declare different models): every member hears it with its own class.
    every_rank = False

    def same_round(self, message: str | None = None) -> CollectiveError:
        """This error as every other member hears it: AbortedError, same culprit and phase (its
        own class when ``every_rank``)."""
        cls = type(self) if self.every_rank else AbortedError
        err = cls(str(self) if message is None else message, culprit=self.culprit, phase=self.phase)
        err.every_rank = self.every_rank
        return err


class UsageError(CollectiveError):
    """An invalid option or configuration value given by the user."""

    code = "INVALID_ARGUMENT"
    exit_code = 2


class ModelError(UsageError):
    """Bad model input: an unreadable, corrupt or invalid model file or spec entry."""


class InvalidVariableError(CollectiveError, ValueError):
    """A variable definition that breaks the variable rules (names the variable)."""

    code = "INVALID_ARGUMENT"
    exit_code = 2


class FrozenError(CollectiveError, RuntimeError):
    """A variable was created after training started; the variable set is frozen then."""

    code = "FAILED_PRECONDITION"


class TransportError(CollectiveError):
    """A message could not be delivered, or the peer is gone."""

    code = "UNAVAILABLE"


class ChiefUnreachableError(TransportError):
    """The chief could not be reached, or stopped answering, within a deadline."""


class AuthError(CollectiveError):
    """The cluster token (or certificate) was refused."""

    code = "UNAUTHENTICATED"
    exit_code = 2


class ProtocolError(CollectiveError):
    """A message broke the wire contract: unknown keys, bad offsets, malformed frames."""

    code = "INVALID_ARGUMENT"


class IntegrityError(CollectiveError):
    """Received bytes do not match what the chief sent: count or digest mismatch."""

    code = "DATA_LOSS"


class JoinTimeoutError(CollectiveError):
    """Not every expected worker joined before the join deadline."""

    code = "DEADLINE_EXCEEDED"


class AbortedError(CollectiveError):
    """The round was aborted; the message says by whom and why."""

    code = "ABORTED"


class AlreadyExistsError(CollectiveError):
    """A second live process claims a worker id that is taken."""

    code = "ALREADY_EXISTS"


class PreconditionError(CollectiveError):
    """The request does not fit the cluster's state (joins closed, not joined, variable lists differ)."""

    code = "FAILED_PRECONDITION"


class ResourceExhaustedError(CollectiveError):
    """The cluster is full."""

    code = "RESOURCE_EXHAUSTED"


class DeadlineError(CollectiveError):
    """A phase did not finish before its deadline; the message names the phase and who is late."""

    code = "DEADLINE_EXCEEDED"


class PermissionDeniedError(CollectiveError):
    """An authenticated peer asked for something its identity does not allow."""

    code = "PERMISSION_DENIED"
    exit_code = 2


class RelayError(TransportError):
    """The worker this one receives from (its relay parent) failed or went silent."""


class FetchError(TransportError):
    """``collective.fetch`` could not complete: no holder serves the step, the holders disagree
    on its manifest, or every holder of some bytes was lost."""


class UnimplementedError(ProtocolError):
    """A server was asked for a call it does not serve (e.g. a control call sent to a relay)."""

    code = "UNIMPLEMENTED"


class DivergenceError(CollectiveError):
    """After start, the ranks' values differ (``collective.check``): raised on every rank with the
    same message, naming each differing tensor and the ranks that differ from the reference (the
    value most ranks hold; on a tie, the lowest rank's). ``culprit`` is those ranks (``rank 2``,
    ``ranks 1,3``), ``phase`` is ``check``; ``ranks`` and ``tensors`` list them."""

    code = "DATA_LOSS"

    def __init__(self, *args: object, culprit: str | None = None, phase: str | None = None,
                 ranks: tuple[int, ...] = (), tensors: tuple[str, ...] = ()) -> None:
        super().__init__(*args, culprit=culprit, phase=phase)
        self.ranks = tuple(ranks)
        self.tensors = tuple(tensors)


class InternalError(CollectiveError):
    """A bug inside the chief or a relay: the message names the call; that process's log has the
    traceback."""

    code = "INTERNAL"


def env_error(name: str, raw: str, why: str) -> UsageError:
    """The one form of a bad value in an environment variable: it names the variable and the
    value (its repr, control characters escaped, cut to 80 characters)."""
    shown = repr(raw[:80]) + (f"...({len(raw) - 80} more)" if len(raw) > 80 else "")
    if name.endswith("_TOKEN"):  # a secret: named, never shown
        return UsageError(f"environment variable {name} (not shown): {why}")
    return UsageError(f"environment variable {name}={shown}: {why}")


# A status that arrives without a class name is read as the one class its code stands for.
FROM_CODE: dict[str, type[CollectiveError]] = {cls.code: cls for cls in (
    UnimplementedError, AuthError, PermissionDeniedError, AlreadyExistsError, ResourceExhaustedError,
    PreconditionError, ProtocolError, DeadlineError, IntegrityError, AbortedError, InternalError,
)}


def family() -> list[type[CollectiveError]]:
    """Every class of this module's error family, CollectiveError first."""
    out, todo = [], [CollectiveError]
    while todo:
        cls = todo.pop(0)
        if cls.__module__ == __name__ and cls not in out:
            out.append(cls)
        todo += cls.__subclasses__()
    return out


def wire_class(name: str | None, code: str | None) -> type[CollectiveError]:
    """The class of an error that arrived as ``name`` (a class of this family) and ``code``:
    by name when it is ours, else by code, else AbortedError (any other failure aborts)."""
    by_name = {cls.__name__: cls for cls in family()}
    name, code = (x if isinstance(x, str) else "" for x in (name, code))  # a peer's JSON may hold anything
    return by_name.get(name) or FROM_CODE.get(code, AbortedError)


def describe(exc: CollectiveError) -> dict[str, str | None]:
    """What travels beside an error's message: its class name, culprit and phase."""
    return {"class": type(exc).__name__, "culprit": exc.culprit, "phase": exc.phase}


def rebuild(info: dict | None, code: str | None, message: str) -> CollectiveError:
    """The error ``describe`` described (its class by name, else by ``code``), with ``message``.
    What a peer sent is bounded first (``limits.peer_error``)."""
    info = info or {}
    cls = wire_class(info.get("class"), code)
    return cls(message, culprit=info.get("culprit"), phase=info.get("phase"))


class StopSignal(BaseException):
    """SIGTERM / SIGINT while the chief loads its model, or SIGTERM to a worker, raised from the
    handler: a BaseException, so no ``except Exception`` in the code it interrupts can swallow
    it (one did, under load: the chief then served on as if never told; logging's ``emit`` did
    for a worker, which then finished its round). ``error`` is what the caller raises."""

    def __init__(self, error: CollectiveError) -> None:
        super().__init__(str(error))
        self.error = error
