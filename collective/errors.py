"""The project's error family.

Every error message is a sentence that names the culprit (worker id and rank, the chief, a
variable, a file) and the rule it broke. ``exit_code`` is what a command-line entry point exits
with when the error reaches it: 2 for usage and input mistakes, 1 for run-time failures.
"""

from __future__ import annotations


class CollectiveError(Exception):
    """Base class of every error this project raises on purpose."""

    exit_code = 1


class UsageError(CollectiveError):
    """An invalid option or configuration value given by the user."""

    exit_code = 2


class ModelError(UsageError):
    """Bad model input: an unreadable, corrupt or invalid model file or spec entry."""


class InvalidVariableError(CollectiveError, ValueError):
    """A variable definition that breaks the variable rules (names the variable)."""

    exit_code = 2


class FrozenError(CollectiveError, RuntimeError):
    """A variable was created after training started; the variable set is frozen then."""


class TransportError(CollectiveError):
    """A message could not be delivered, or the peer is gone."""


class ChiefUnreachableError(TransportError):
    """The chief could not be reached, or stopped answering, within a deadline."""


class AuthError(CollectiveError):
    """The cluster token (or certificate) was refused."""

    exit_code = 2


class ProtocolError(CollectiveError):
    """A message broke the wire contract: unknown keys, bad offsets, malformed frames."""


class IntegrityError(CollectiveError):
    """Received bytes do not match what the chief sent: count or digest mismatch."""


class JoinTimeoutError(CollectiveError):
    """Not every expected worker joined before the join deadline."""


class AbortedError(CollectiveError):
    """The round was aborted; the message says by whom and why."""


class AlreadyExistsError(CollectiveError):
    """A second live process claims a worker id that is taken."""


class PreconditionError(CollectiveError):
    """The request does not fit the cluster's state (joins closed, not joined, variable lists differ)."""


class ResourceExhaustedError(CollectiveError):
    """The cluster is full."""


class DeadlineError(CollectiveError):
    """A phase did not finish before its deadline; the message names the phase and who is late."""


class PermissionDeniedError(CollectiveError):
    """An authenticated peer asked for something its identity does not allow."""

    exit_code = 2


class RelayError(TransportError):
    """The worker this one receives from (its relay parent) failed or went silent."""


class UnimplementedError(ProtocolError):
    """A server was asked for a call it does not serve (e.g. a control call sent to a relay)."""


class InternalError(CollectiveError):
    """A bug inside the chief or a relay: the message names the call; that process's log has the
    traceback."""
