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
from dataclasses import dataclass, replace
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
    return _bounded_seconds(text, v)


def non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{quoted_text(text)} is not a number of seconds") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"{quoted_text(text)} must be 0 or more")
    return _bounded_seconds(text, v)


# The longest wait an option may set: a job lives for days, and every wait has a deadline (an
# infinite one is no deadline; 1e300 s overflows the waits' own clocks: OverflowError).
MAX_SECONDS = 30 * 86400


def _bounded_seconds(text: str, v: float) -> float:
    if not v <= MAX_SECONDS:  # inf, and NaN
        raise argparse.ArgumentTypeError(f"{quoted_text(text)} is more than {MAX_SECONDS} seconds (30 days): every "
                                         f"wait has a deadline; give a finite number of seconds")
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


def _env_default(name: str, parse: Callable[[str], Any], default: Any, choices: Iterable[Any] | None) -> Any:
    """The default of ``--name``: ``COLLECTIVE_<NAME>`` parsed by ``parse`` if set, else ``default``.

    A bad value becomes a ``BadEnvironment``, reported when arguments are parsed, naming the
    variable, if the command that runs has the option."""
    env = env_name(name)
    raw = environ().get(env)
    if raw in (None, ""):
        return default
    try:
        value = parse(raw)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        return BadEnvironment(env_error(env, raw, str(exc)))
    # argparse checks choices only of what the command line gives, never of a default
    if choices is not None and value not in choices:
        return BadEnvironment(env_error(env, raw, f"not one of {', '.join(map(str, choices))}"))
    return value


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
    """One option: ``--name`` on a command line, ``COLLECTIVE_<NAME>`` in the environment (unless
    ``env`` is off), a field ``name_with_underscores`` of a settings object. One table of these
    (``collective.options.FLAGS``) makes every command's argparse parser (``add_flags``) and the
    settings read without one (``settings_from_env``). ``help`` is plain words without the
    default: ``add_flags`` appends the default (``shown``, else the value) and the variable."""

    name: str
    help: str
    parse: Callable[[str], Any] = str
    default: Any = None
    choices: tuple[str, ...] | None = None
    boolean: bool = False  # --name / --no-name
    switch: bool = False  # --name alone turns it on (store_true): command line only
    env: bool = True  # read COLLECTIVE_<NAME>
    required: bool = False
    to: str | None = None  # the attribute it parses into, if not the name's
    metavar: str | None = None
    shown: str | None = None  # the default in words, where the value alone does not say it

    @property
    def dest(self) -> str:
        return self.to or self.name.replace("-", "_")

    def but(self, **changes: Any) -> Flag:
        """This option as one command takes it: another default (launch's two workers), no
        variable, required, another attribute; its definition and help stay the one."""
        return replace(self, **changes)

    def suffix(self) -> str:
        """`` (default: ...; env COLLECTIVE_...)`` as ``--help`` shows it after the help text."""
        parts = []
        if self.shown is not None:
            parts.append(f"default: {self.shown}")
        elif self.boolean:
            parts.append(f"default: {'on' if self.default else 'off'}")
        elif self.default is not None and not self.switch:
            parts.append(f"default: {self.default:g}" if isinstance(self.default, float) else f"default: {self.default}")
        if self.env and not self.switch:
            parts.append(f"env {env_name(self.name)}")
        return f" ({'; '.join(parts)})" if parts else ""


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag]) -> None:
    """Add each flag to ``parser``, its default read from its ``COLLECTIVE_*`` variable; each
    argparse action keeps the ``Flag`` it came from (``action.flag``)."""
    for f in flags:
        if f.help == argparse.SUPPRESS:
            helptext = f.help
        else:
            helptext = f.help + f.suffix()
        extra: dict[str, Any] = {"help": helptext, "dest": f.dest}
        if f.metavar:
            extra["metavar"] = f.metavar
        if f.required:
            extra["required"] = True
        if f.switch:
            action = parser.add_argument(f"--{f.name}", action="store_true", **extra)
        else:
            if f.choices:
                extra["choices"] = list(f.choices)
            if f.boolean:
                extra["action"] = argparse.BooleanOptionalAction
            default = _env_default(f.name, f.parse, f.default, f.choices) if f.env else f.default
            action = parser.add_argument(f"--{f.name}", type=f.parse, default=default, **extra)
        action.flag = f  # type: ignore[attr-defined]


def settings_from_env(flags: Iterable[Flag], env: Mapping[str, str], skip: Iterable[str] = ()) -> dict[str, Any]:
    """Each flag's value as the command would have it with no arguments: its ``COLLECTIVE_*``
    variable parsed, else its default. A bad value is a UsageError naming the variable; the
    variables of the flags named in ``skip`` are not read (an explicit argument replaces them)."""
    skipped = set(skip)
    out: dict[str, Any] = {}
    for f in flags:
        raw = None if f.name in skipped or not f.env else env.get(env_name(f.name))
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
        except UsageError as exc:  # argparse (or add_flags, for the environment) names the source
            raise argparse.ArgumentTypeError(str(exc)) from None

    return size
