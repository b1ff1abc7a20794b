"""Settings shared by the chief, the workers and the launcher.

Precedence is the same everywhere: an explicit command-line option beats a ``COLLECTIVE_*``
environment variable, which beats the default. Every wait in the service has a deadline taken
from ``Timeouts``; tests shrink them.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from collective.errors import UsageError, env_error
from collective.logs import quoted_text

ENV_PREFIX = "COLLECTIVE_"

# The environment options are read from: os.environ, unless the Python API (collective._api)
# reads the CLI's options from an overlay (os.environ plus what TF_CONFIG/torchrun imply)
# without changing the process's environment.
_ENVIRON: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("collective_environ", default=None)


def environ() -> Mapping[str, str]:
    """The environment settings are read from (``os.environ`` unless inside ``reading``)."""
    overlay = _ENVIRON.get()
    return os.environ if overlay is None else overlay


@contextlib.contextmanager
def reading(env: Mapping[str, str]) -> Iterator[None]:
    """Read ``COLLECTIVE_*`` settings from ``env`` instead of ``os.environ`` in this context."""
    token = _ENVIRON.set(env)
    try:
        yield
    finally:
        _ENVIRON.reset(token)


@dataclass(frozen=True)
class Timeouts:
    """One deadline per phase, in seconds."""

    join: float = 300.0          # chief: all workers joined; worker: chief reachable and plan released
    straggler_log: float = 10.0  # how often the chief names whom it is still waiting for
    rpc: float = 30.0            # a single request/reply exchange
    stall: float = 30.0          # longest gap between two messages of a data stream
    ready: float = 600.0         # chief: from plan release until every worker reported ready
    start: float = 900.0         # worker: from ready until start is released
    # chief: the most it keeps serving after the outcome until every worker heard it (one that
    # cannot, gone or silent for a lease, is not waited for: chief/supervise.py, Supervisor.linger)
    linger: float = 30.0
    status_grace: float = 0.5    # chief: keep answering Status this long after the outcome, for watchers
    heartbeat: float = 5.0       # worker: seconds between heartbeats, from join until start
    lease: float = 15.0          # both: a peer silent this long is dead (chief: no heartbeat; worker: no answer)
    # chief: how long a worker lost mid-broadcast may take to rejoin (a restart, same id) before
    # the round fails naming it; 0 (the default, as torchrun's --max-restarts 0): a loss fails
    # the round at once. Set it where a supervisor restarts workers (Kubernetes, systemd).
    rejoin: float = 0.0


def plain(doc: str | None) -> str:
    """A docstring as a command's ``--help`` shows it: without reStructuredText's literal quotes."""
    return (doc or "").replace("``", "")


class Parser(argparse.ArgumentParser):
    """Every command's parser: no option may be abbreviated (``--devices 2`` must not silently
    mean ``--devices-per-worker 2``), and an unknown option is refused with the usage of the
    (sub)command it was given to and the option it most likely meant."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            parser = self
            while (sub := parser._chosen(parsed)) is not None:
                parser = sub
            parser.error(parser._unrecognized(extra))
        for value in vars(parsed).values():  # only the options of the (sub)command that runs
            if isinstance(value, BadEnvironment):
                raise value.error
        return parsed

    def _chosen(self, parsed: argparse.Namespace) -> argparse.ArgumentParser | None:
        """The parser of the subcommand ``parsed`` names, if this parser has subcommands."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):  # argparse keeps them nowhere public
                sub = action.choices.get(getattr(parsed, action.dest, None) or "")
                return sub if isinstance(sub, Parser) else None
        return None

    def _unrecognized(self, extra: list[str]) -> str:
        import difflib

        known = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        hints = []
        for arg in extra:
            if not arg.startswith("--"):
                continue
            name = arg.split("=", 1)[0]
            near = [s for s in known if s.startswith(name)] or difflib.get_close_matches(name, known, n=1, cutoff=0.7)
            if near:
                hints.append(f"{name}: did you mean {' or '.join(near[:3])}?")
        return f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else "")


class BadEnvironment:
    """The default of an option whose ``COLLECTIVE_*`` value is bad: refused by ``Parser`` when
    arguments are parsed, and only if the command that runs has that option and the command line
    does not set it (``COLLECTIVE_TRANSPORT=foo`` must not break ``collective --version`` or
    ``collective status``)."""

    def __init__(self, error: UsageError) -> None:
        self.error = error

    def __repr__(self) -> str:
        return "(a bad environment value)"


def env_name(option: str) -> str:
    return ENV_PREFIX + option.upper().replace("-", "_")


def env_default(option: str, default: Any = None) -> Any:
    """The ``COLLECTIVE_<OPTION>`` environment value if set and non-empty, else ``default``."""
    value = environ().get(env_name(option))
    return value if value not in (None, "") else default


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{quoted_text(text)} is not a number of seconds") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{quoted_text(text)} must be greater than 0")
    return v


def non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{quoted_text(text)} is not a number of seconds") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"{quoted_text(text)} must be 0 or more")
    return v


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    low = str(text).strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{quoted_text(text)} is not true or false")


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{quoted_text(text)} is not a whole number") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{quoted_text(text)} must be at least 1")
    return v


def token_text(text: str) -> str:
    """A cluster token as the command line or the environment gives it: printable ASCII, the
    only characters a gRPC metadata value carries (a newline or an accented letter failed every
    call with "Invalid metadata", blamed on whoever made the first one)."""
    bad = token_problem(text)
    if bad:
        raise argparse.ArgumentTypeError(bad)
    return text


def token_problem(token: str) -> str | None:
    """Why ``token`` cannot be a cluster token, or None."""
    for i, c in enumerate(token):
        if not " " <= c <= "~":
            # Not the character itself: the token is a secret.
            return (f"the token's character {i + 1} is not printable ASCII (a newline, a control character or a "
                    f"non-ASCII letter), the only characters gRPC metadata carries; use letters, digits and "
                    f"punctuation")
    return None


def add_option(
    parser: argparse.ArgumentParser,
    name: str,
    *,
    help: str,
    type: Callable[[str], Any] = str,
    default: Any = None,
    **kwargs: Any,
) -> None:
    """Add ``--name`` whose default comes from ``COLLECTIVE_<NAME>``, then ``default``.

    The environment value is parsed by ``type`` here; a bad one is reported when arguments are
    parsed (``BadEnvironment``), naming the variable, if the command that runs has the option.
    """
    env = env_name(name)
    raw = environ().get(env)
    if raw not in (None, ""):
        try:
            default = type(raw)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            default = BadEnvironment(env_error(env, raw, str(exc)))
        # argparse checks choices only of what the command line gives, never of a default
        choices = kwargs.get("choices")
        if choices is not None and not isinstance(default, BadEnvironment) and default not in choices:
            default = BadEnvironment(env_error(env, raw, f"not one of {', '.join(map(str, choices))}"))
    parser.add_argument(
        f"--{name}", type=type, default=default, help=f"{help} (env {env})", **kwargs
    )


def parse_address(text: str, *, what: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[v6]:PORT`` -> (host, port). Raises UsageError naming ``what``."""
    host, sep, port = text.rpartition(":")
    # ASCII digits, at most 5: "²" passes isdigit and a 5,000-digit port is past what int() reads
    if not sep or not host or not (port.isascii() and port.isdigit() and len(port) <= 5) or int(port) > 65535:
        raise UsageError(f"{what} {quoted_text(text)} is not HOST:PORT (for example 127.0.0.1:50051)")
    return host.strip("[]"), int(port)


def timeouts_from_args(args: argparse.Namespace) -> Timeouts:
    fields = {k: getattr(args, k + "_timeout") for k in ("join", "stall", "ready", "start", "rejoin")
              if hasattr(args, k + "_timeout")}
    if getattr(args, "linger", None) is not None:
        fields["linger"] = args.linger
    if hasattr(args, "heartbeat_interval"):
        fields["heartbeat"] = args.heartbeat_interval
        fields["lease"] = args.heartbeat_timeout
    t = Timeouts(**{k: v for k, v in fields.items() if v is not None})
    if t.lease <= t.heartbeat:
        raise UsageError(
            f"--heartbeat-timeout ({t.lease:g} s) must be longer than --heartbeat-interval ({t.heartbeat:g} s)"
        )
    return t


@dataclass(frozen=True)
class Flag:
    """One setting: ``--name`` on a command line, ``COLLECTIVE_<NAME>`` in the environment, a field
    ``name_with_underscores`` of a settings object. One table of these makes both the argparse
    parser (``add_flags``) and the settings read without one (``settings_from_env``)."""

    name: str
    help: str
    parse: Callable[[str], Any] = str
    default: Any = None
    choices: tuple[str, ...] | None = None
    boolean: bool = False  # --name / --no-name

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag]) -> None:
    """Add each flag, its default read from its ``COLLECTIVE_*`` variable (``add_option``)."""
    for f in flags:
        extra: dict[str, Any] = {}
        if f.choices:
            extra["choices"] = list(f.choices)
        if f.boolean:
            extra["action"] = argparse.BooleanOptionalAction
        add_option(parser, f.name, help=f.help, type=f.parse, default=f.default, **extra)


def settings_from_env(flags: Iterable[Flag], env: Mapping[str, str], skip: Iterable[str] = ()) -> dict[str, Any]:
    """Each flag's value as the command would have it with no arguments: its ``COLLECTIVE_*``
    variable parsed, else its default. A bad value is a UsageError naming the variable; the
    variables of the flags named in ``skip`` are not read (an explicit argument replaces them)."""
    skipped = set(skip)
    out: dict[str, Any] = {}
    for f in flags:
        raw = None if f.name in skipped else env.get(env_name(f.name))
        value = f.default
        if raw not in (None, ""):
            try:
                value = f.parse(raw)
            except (argparse.ArgumentTypeError, ValueError) as exc:
                raise env_error(env_name(f.name), raw, str(exc)) from None
            if f.choices and value not in f.choices:
                raise env_error(env_name(f.name), raw, f"not one of {', '.join(f.choices)}")
        out[f.dest] = value
    return out


def timeout_flags(*phases: str) -> tuple[Flag, ...]:
    """The deadline flags of ``phases`` (``heartbeat``: its interval and timeout)."""
    helps = {
        "join": "seconds to wait for every worker to join (chief) or for the chief and plan (worker)",
        "stall": "longest silence tolerated inside a data stream",
        "ready": "seconds from plan release until every worker is ready",
        "start": "seconds a ready worker waits for start",
        "rejoin": "seconds the chief waits for a worker lost mid-broadcast to come back (restarted with the same "
                  "--worker-id) before failing the round naming it",
    }
    defaults = Timeouts()
    out: list[Flag] = []
    if "heartbeat" in phases:
        out.append(Flag("heartbeat-interval", f"seconds between a worker's heartbeats; default {defaults.heartbeat:g}",
                        positive_float, defaults.heartbeat))
        out.append(Flag("heartbeat-timeout", f"a peer silent this long is declared dead; default {defaults.lease:g}",
                        positive_float, defaults.lease))
    out += [Flag(f"{p}-timeout", helps[p] + f"; default {getattr(defaults, p):g}", positive_float, getattr(defaults, p))
            for p in phases if p not in ("heartbeat", "rejoin", "linger")]
    if "linger" in phases:
        out.append(Flag("linger", "the most seconds the chief keeps serving after the outcome until every worker has "
                        f"heard it (a worker gone, or silent for a heartbeat timeout, is not waited for); default "
                        f"{defaults.linger:g}", positive_float, defaults.linger))
    if "rejoin" in phases:
        out.append(Flag("rejoin-timeout", helps["rejoin"] + "; default 0: a loss fails the round at once",
                        non_negative_float, defaults.rejoin))
    return tuple(out)


def tls_flags(*, worker: bool) -> tuple[Flag, ...]:
    if worker:
        return (
            Flag("tls-ca", "CA certificate (PEM) that signed the chief's certificate; enables TLS"),
            Flag("tls-cert", "this worker's certificate (PEM), for mutual TLS; its CN/SAN must be the worker id"),
            Flag("tls-key", "this worker's private key (PEM)"),
            Flag("tls-server-name", "name the chief's certificate must carry, if not the dialled host"),
        )
    return (
        Flag("tls-cert", "the chief's certificate (PEM); enables TLS"),
        Flag("tls-key", "the chief's private key (PEM)"),
        Flag("tls-ca", "CA (PEM) of worker certificates: mutual TLS, client certificates required"),
    )


def add_timeout_options(parser: argparse.ArgumentParser, *phases: str) -> None:
    add_flags(parser, timeout_flags(*phases))


def add_tls_options(parser: argparse.ArgumentParser, *, worker: bool) -> None:
    add_flags(parser, tls_flags(worker=worker))


@dataclass(frozen=True)
class TlsFiles:
    """PEM files. Chief: cert+key (its own), ca (clients' CA: mutual TLS, client auth required).
    Worker: ca (the CA of the chief's certificate), cert+key (its client certificate, for mTLS).

    ``*_pem``: the same in memory instead of a file (a relay's own certificate, see
    ``relay_server_tls``); a value here wins over the path."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None  # worker: the name the chief's certificate must carry
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    ca_pem: bytes | None = None

    def has(self, which: str) -> bool:
        return bool(getattr(self, which) or getattr(self, which + "_pem"))

    @property
    def enabled(self) -> bool:
        return any(self.has(w) for w in ("cert", "key", "ca"))

    @property
    def mutual(self) -> bool:
        """A worker with a certificate of its own and the CA: mutual TLS."""
        return self.has("cert") and self.has("ca")

    def read(self, which: str) -> bytes | None:
        inline = getattr(self, which + "_pem")
        if inline:
            return inline
        path = getattr(self, which)
        if not path:
            return None
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise UsageError(f"--tls-{which} {path}: cannot read it ({exc.strerror})") from None
        if b"-----BEGIN" not in data:
            raise UsageError(f"--tls-{which} {path}: not a PEM file")
        return data


def tls_from_args(args: argparse.Namespace) -> TlsFiles:
    return TlsFiles(
        cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca, server_name=getattr(args, "tls_server_name", None)
    )


def byte_size(option: str) -> Callable[[str], int]:
    """An argparse type for a byte count: ``4MiB``, ``512KiB``, ``65536`` (``sizes.parse_size``)."""

    def size(text: str) -> int:
        from collective.sizes import parse_size

        try:
            return parse_size(text, option=option)
        except UsageError as exc:  # argparse (or add_option, for the environment) names the source
            raise argparse.ArgumentTypeError(str(exc)) from None

    return size


def max_model_bytes_flag() -> Flag:
    """``--max-model-bytes`` (``COLLECTIVE_MAX_MODEL_BYTES``) of every process that loads a model."""
    return Flag("max-model-bytes", "refuse (exit 2) a model whose arena is larger, e.g. 8GiB; the memory available "
                "is always checked", byte_size("--max-model-bytes"))


def add_max_model_bytes_option(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, (max_model_bytes_flag(),))
