"""The one flag table (``FLAGS``): every option of every command (chief, worker, launch, mpi,
status, logs, fetch, doctor) defined once, with one help text; each command's selection of it
(``CHIEF_FLAGS``, ``WORKER_FLAGS``, ``LAUNCH_FLAGS``, ...) makes its parser. The roles' tables
also make the settings dataclasses the Python API reads (``ChiefSettings.from_env()``, no
parser), so the flags, their ``COLLECTIVE_*`` variables and the API's defaults cannot drift
apart. Below both the entry points and the API, so neither imports the other.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from collective import logs
from collective.clusterenv import apply_to_environ, role_mismatch
from collective.config import (
    Flag,
    Parser,
    Timeouts,
    add_flags,
    byte_size,
    non_negative_float,
    parse_bool,
    positive_float,
    positive_int,
    settings_from_env,
    token_text,
)
from collective.entry import run_main
from collective.topology import TOPOLOGIES
from collective.transport import registry

log = logging.getLogger("collective")

CHIEF_DESCRIPTION = 'python -m collective.chief: serve one broadcast round over gRPC and exit 0 once start is released.'
WORKER_DESCRIPTION = 'python -m collective.worker: join the chief, receive and verify the variables, wait for start.'


def parse_shards(text: str):
    """``--shards``: ``dim0``, or a JSON object name -> placement (``collective.shards``)."""
    text = text.strip()
    if text == "dim0":
        return text
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text[:80]!r} is not dim0 or a JSON object name -> placement "
                                         f"(\"dim0\", \"all\", a rank or a list of ranks)")
    return value


_TIMEOUTS = Timeouts()


def _table(*flags: Flag) -> dict[str, Flag]:
    table: dict[str, Flag] = {}
    for f in flags:
        if f.name in table:
            raise ValueError(f"--{f.name} is defined twice in the flag table")
        table[f.name] = f
    return table


# Every option of every command (chief, worker, launch, mpi, status, logs, fetch, doctor), once:
# one definition, one help text in plain words. A command takes an entry as it is, or with
# another default (``Flag.but``), and fills the words in braces that name its own peers and
# output (``flags(words=)``); ``--help`` appends the default and the variable.
FLAGS: dict[str, Flag] = _table(
    # What runs and how much of it.
    Flag("workers", "number of workers the round waits for", positive_int),
    Flag("model", "the model: a preset name (mlp, transformer-100m), a .yaml/.json spec, a .npz or .safetensors "
         "file, a *.safetensors.index.json or a checkpoint directory", default="mlp"),
    Flag("seed", "seed of an initializer spec's random values", int, shown="the spec's own"),
    Flag("transport", "grpc (chief and workers on loopback) or mpi (mpiexec -n N+1)", default="grpc",
         choices=tuple(registry.names("launch"))),
    Flag("devices-per-worker", "devices (replicas) per worker", positive_int, 1),
    Flag("chief-trains", "rank 0 trains too: it holds verified replicas of its own (--no-chief-trains: it only "
         "serves)", parse_bool, False, boolean=True),
    # Where the chief is, and who may call it.
    Flag("bind", "HOST:PORT the chief listens on; port 0 picks a free port", default="0.0.0.0:50051"),
    Flag("chief", "the chief's HOST:PORT"),
    Flag("token", "the cluster token: the chief (or a holder) refuses every call without it; workers, status, "
         "doctor and fetch present it", parse=token_text),
    # A worker.
    Flag("devices", "this worker's local devices, comma-separated, one replica each", default="cpu:0"),
    Flag("worker-id", "this worker's id", shown="HOSTNAME-PID"),
    Flag("rank", "preferred rank (the chief gives another if it is taken; -1: any)", int, -1),
    Flag("expect-model", "refuse to join unless the chief's variables match this model's (a preset, spec, .npz or "
         ".safetensors; only names, shapes, dtypes and modes are read)", shown="none: any model"),
    # How the bytes travel.
    Flag("shm", "same-host workers take the arena through shared memory, the chief's or this host's receiving "
         "worker's (--no-shm: network only)", parse_bool, True, boolean=True),
    Flag("topology", "who receives from whom: auto (by hosts and size, see the docs' Concepts), star, tree, chain "
         "or dtree", default="auto", choices=TOPOLOGIES),
    Flag("chunk-bytes", "bytes per data message (chunk), e.g. 1MiB: the unit of digests and checks",
         byte_size("--chunk-bytes"), shown="4 MiB, 512 KiB for a chain or dtree"),
    Flag("split-bytes", "largest MPI Bcast call, in whole chunks; must stay below 2 GiB", positive_int,
         shown="256 MiB"),
    Flag("shards", "each worker receives a part of the model, not a replica: dim0 (torch's Shard(0) of every "
         "variable over the workers) or a JSON object name -> \"dim0\" / \"all\" / rank(s), \"*\" for the rest "
         "(over gRPC: a star, without shared memory)", parse_shards, shown="none: every worker a whole replica"),
    Flag("from-file", "serve a .safetensors model straight from its file(s), mapped read-only, not a copy in "
         "memory (same-host workers map the files)", parse_bool, False, boolean=True),
    Flag("max-model-bytes", "refuse (exit 2) a model whose arena is larger, e.g. 8GiB; the memory available is "
         "always checked", byte_size("--max-model-bytes"), shown="none: the memory available is the limit"),
    # Deadlines, in seconds.
    Flag("heartbeat-interval", "seconds between a worker's heartbeats", positive_float, _TIMEOUTS.heartbeat),
    Flag("heartbeat-timeout", "seconds of silence after which a peer is declared dead", positive_float,
         _TIMEOUTS.lease),
    Flag("join-timeout", "seconds for every worker to join and get the plan: the chief waits this long for all "
         "of them, a worker for the chief and its plan", positive_float, _TIMEOUTS.join),
    Flag("stall-timeout", "seconds a data stream may stay silent before its sender is given up (a fetch: that "
         "holder's share goes to the others)", positive_float, _TIMEOUTS.stall),
    Flag("ready-timeout", "seconds from the plan's release until every worker is ready", positive_float,
         _TIMEOUTS.ready),
    Flag("start-timeout", "seconds a ready worker waits for start", positive_float, _TIMEOUTS.start),
    Flag("linger", "the most seconds the chief keeps serving after the outcome until every worker has heard it (a "
         "worker gone, or silent for a heartbeat timeout, is not waited for)", positive_float, _TIMEOUTS.linger),
    Flag("rejoin-timeout", "seconds the chief waits for a worker lost mid-broadcast to come back (restarted with "
         "the same --worker-id) before failing the round naming it; 0: a loss fails the round at once",
         non_negative_float, _TIMEOUTS.rejoin),
    Flag("timeout", "seconds before giving up on {timed}", positive_float, env=False),
    # TLS, on the calling side (a worker, doctor, a fetch); the chief's own are CHIEF_TLS.
    Flag("tls-ca", "CA certificate (PEM) that signed {server}'s certificate; turns TLS on"),
    Flag("tls-cert", "{caller}'s own certificate (PEM), for mutual TLS: {identity}"),
    Flag("tls-key", "the private key (PEM) of --tls-cert"),
    Flag("tls-server-name", "the name {server}'s certificate must carry, if not the host dialled"),
    # What a command writes and shows.
    Flag("log-format", "how log lines look: text, or json (one object per line)", default="text",
         choices=("text", "json")),
    Flag("port-file", "write the bound port here once serving (for launchers)"),
    Flag("result-file", "write the round's JSON summary here (under MPI rank 0 does, also when it aborts the "
         "job)"),
    Flag("run-dir", "a launch's run directory, this user's and not writable by others: launch writes each "
         "process's log, the summary and, while it runs, the chief's address and token there; status and logs "
         "read it"),
    Flag("keep-run-dir", "keep the temporary run dir of a successful run too (a failed run's is always kept)",
         switch=True),
    Flag("json", "for scripts: {json}", switch=True),
    Flag("quiet", "do not echo the processes' log lines", switch=True),
    Flag("no-table", argparse.SUPPRESS, switch=True),  # mpi under collective launch, which prints its own
    Flag("watch", "redraw every --interval seconds until start or failure", switch=True),
    Flag("interval", "seconds between redraws with --watch", float, 1.0, env=False),
    Flag("worker", "only this worker: id (worker-1) or rank (1)", env=False),
    Flag("phase", "only this phase (join, broadcast, receive, verify, ready, start, started, failed)", env=False),
    # A fetch.
    Flag("from", "the holders' HOST:PORT, comma-separated: the fetch is striped over them", to="sources",
         metavar="ADDR[,ADDR]", required=True, env=False),
    Flag("step", "the step to fetch", int, required=True, env=False),
    Flag("out", "FILE.safetensors (the non-tensor values in its __metadata__) or FILE.npz (tensors only)",
         required=True, env=False),
)

# The chief's TLS files: the serving side of the same three names, so their own words.
CHIEF_TLS: tuple[Flag, ...] = (
    Flag("tls-cert", "the chief's certificate (PEM); turns TLS on"),
    Flag("tls-key", "the chief's private key (PEM)"),
    Flag("tls-ca", "CA certificate (PEM) that signed the workers' certificates: mutual TLS, every worker must "
         "present one"),
)


def flags(*names: str, words: Mapping[str, str] | None = None, **changed: dict[str, Any]) -> tuple[Flag, ...]:
    """The table's entries for ``names``, in that order; ``changed``: name (with underscores) ->
    what one command takes differently (``Flag.but``); ``words`` fill the braces of a help text."""
    out = []
    for n in names:
        f = FLAGS[n].but(**changed.get(n.replace("-", "_"), {}))
        out.append(f.but(help=f.help.format(**words)) if words and "{" in f.help else f)
    return tuple(out)


_CLIENT_TLS = ("tls-ca", "tls-cert", "tls-key", "tls-server-name")
CHIEF_FLAGS: tuple[Flag, ...] = (
    *flags("workers", "model", "seed", "bind", "token", workers={"shown": "none: required"}), *CHIEF_TLS,
    *flags("shm", "topology", "chunk-bytes", "shards", "from-file", "heartbeat-interval", "heartbeat-timeout",
           "join-timeout", "ready-timeout", "linger", "rejoin-timeout", "log-format", "max-model-bytes", "port-file",
           "result-file"),
)
_WORKER_WORDS = {"server": "the chief", "caller": "this worker", "identity": "its CN or SAN must be the worker id"}
WORKER_FLAGS: tuple[Flag, ...] = flags(
    "chief", "devices", "worker-id", "rank", "token", *_CLIENT_TLS, "shm", "expect-model", "heartbeat-interval",
    "heartbeat-timeout", "join-timeout", "stall-timeout", "start-timeout", "log-format", words=_WORKER_WORDS)
LAUNCH_FLAGS: tuple[Flag, ...] = flags(
    "workers", "transport", "devices-per-worker", "model", "seed", "token", "run-dir", "keep-run-dir", "chunk-bytes",
    "heartbeat-interval", "heartbeat-timeout", "join-timeout", "ready-timeout", "start-timeout", "topology", "shm",
    "from-file", "shards", "json", "quiet", words={"json": "the summary as one JSON line, printed last"},
    workers={"default": 2}, token={"shown": "a random one per run"},
    run_dir={"shown": "a new temp dir, removed after a successful run"})
MPI_FLAGS: tuple[Flag, ...] = flags(
    "model", "seed", "max-model-bytes", "shards", "from-file", "devices-per-worker", "chief-trains", "chunk-bytes",
    "split-bytes", "join-timeout", "ready-timeout", "start-timeout", "log-format", "json", "result-file", "no-table",
    words={"json": "rank 0 prints the summary as one JSON line, last"})
STATUS_FLAGS: tuple[Flag, ...] = flags("chief", "token", "run-dir", "json", "watch", "interval", run_dir={"env": False},
                                       words={"json": "one JSON object instead of the table"})
LOGS_FLAGS: tuple[Flag, ...] = flags("run-dir", "worker", "phase", "json", words={"json": "one JSON object per line"},
                                     run_dir={"env": False, "to": "run_dir_option", "metavar": "DIR"})
FETCH_FLAGS: tuple[Flag, ...] = flags("from", "step", "out", "token", "timeout", "stall-timeout", *_CLIENT_TLS,
                                      timeout={"default": 300.0}, stall_timeout={"env": False},
                                      words={"server": "each holder", "caller": "this fetcher",
                                             "identity": "its CN is the id the fetch presents to the holders",
                                             "timed": "the whole fetch"})
DOCTOR_FLAGS: tuple[Flag, ...] = flags("chief", "token", *_CLIENT_TLS, "timeout", "json", timeout={"default": 3.0},
                                       words={**_WORKER_WORDS, "timed": "each network check",
                                              "json": "one JSON object instead of the checks' lines"})


def _settings_class(name: str, flags: tuple[Flag, ...], doc: str):
    cls = dataclasses.make_dataclass(name, [(f.dest, Any, dataclasses.field(default=f.default)) for f in flags],
                                     frozen=True)
    cls.__doc__ = doc
    cls.__module__ = __name__

    def from_env(klass, env: Mapping[str, str] | None = None, skip: tuple[str, ...] = ()):
        """The settings as the command has them with no arguments: ``COLLECTIVE_*`` (``env``,
        default the process's), else the defaults; the flags in ``skip`` keep their defaults."""
        return klass(**settings_from_env(flags, os.environ if env is None else env, skip))

    cls.from_env = classmethod(from_env)
    cls.flags = flags
    return cls


ChiefSettings = _settings_class("ChiefSettings", CHIEF_FLAGS, "What ``python -m collective.chief`` and "
                                "``collective.serve`` run with; a field per flag of CHIEF_FLAGS.")
WorkerSettings = _settings_class("WorkerSettings", WORKER_FLAGS, "What ``python -m collective.worker`` and "
                                 "``collective.join`` run with; a field per flag of WORKER_FLAGS.")


def chief_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m collective.chief``, made from CHIEF_FLAGS."""
    p = Parser(prog="python -m collective.chief", description=CHIEF_DESCRIPTION)
    add_flags(p, CHIEF_FLAGS)
    return p


def worker_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m collective.worker``, made from WORKER_FLAGS."""
    p = Parser(prog="python -m collective.worker", description=WORKER_DESCRIPTION)
    add_flags(p, WORKER_FLAGS)
    return p


def role_main(role: str, run: Callable[[argparse.Namespace], int], argv: list[str] | None) -> int:
    """The start of ``python -m collective.chief`` / ``collective.worker``: TF_CONFIG and torchrun
    variables become ``COLLECTIVE_*`` defaults before the parser reads them, logs are set up,
    the cluster is described (and a role it gives to another process is warned about), then
    ``run(args)``; errors become one line and an exit code (``entry.run_main``)."""

    def go() -> int:
        cluster = apply_to_environ(role)
        args = (chief_parser if role == "chief" else worker_parser)().parse_args(argv)
        logs.configure(role, fmt=args.log_format)
        if cluster is not None:
            log.info("cluster from %s", cluster.describe())
            warning = role_mismatch(cluster, role)
            if warning:
                log.warning("%s", warning)
        return run(args)

    return run_main(go)
