"""The settings of the two roles, one table of flags each (``CHIEF_FLAGS``, ``WORKER_FLAGS``):
the table makes the command-line parser of ``python -m collective.chief`` / ``collective.worker``
and the settings dataclass the Python API reads (``ChiefSettings.from_env()``, no parser), so the
flags, their ``COLLECTIVE_*`` variables and the API's defaults cannot drift apart. Below both
the entry points and the API, so neither imports the other.
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
    add_flags,
    byte_size,
    max_model_bytes_flag,
    parse_bool,
    positive_int,
    settings_from_env,
    timeout_flags,
    tls_flags,
    token_text,
)
from collective.entry import run_main
from collective.topology import TOPOLOGIES

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


CHIEF_FLAGS: tuple[Flag, ...] = (
    Flag("workers", "number of workers to wait for", positive_int),
    Flag("model", "model: preset name (mlp, transformer-100m), .yaml/.json spec, .npz or .safetensors file, "
         "a *.safetensors.index.json or a checkpoint directory", default="mlp"),
    Flag("seed", "seed for initializer specs (overrides the spec's)", int),
    Flag("bind", "HOST:PORT to listen on; port 0 picks a free port", default="0.0.0.0:50051"),
    Flag("token", "cluster token every worker must present", parse=token_text),
    *tls_flags(worker=False),
    Flag("shm", "offer the arena to workers on this host through shared memory (--no-shm: network only)",
         parse_bool, True, boolean=True),
    Flag("topology", "who receives from whom: auto (by hosts and size, see the docs' Concepts), star, tree, chain, dtree",
         default="auto", choices=TOPOLOGIES),
    Flag("chunk-bytes", "bytes per data message; default 4 MiB, 512 KiB for a chain or dtree", byte_size("--chunk-bytes")),
    Flag("shards", "each worker receives a part of the model, not a replica: dim0 (torch's Shard(0) of every "
         "variable over the workers) or a JSON object name -> \"dim0\" / \"all\" / rank(s), \"*\" for the rest; "
         "a star, without shared memory", parse_shards),
    Flag("from-file", "serve a .safetensors model straight from its file(s), mapped read-only, instead of a copy "
         "in memory (same-host workers map the files)", parse_bool, False, boolean=True),
    *timeout_flags("join", "ready", "heartbeat", "rejoin", "linger"),
    Flag("log-format", "text or json", default="text", choices=("text", "json")),
    max_model_bytes_flag(),
    Flag("port-file", "write the bound port here once serving (for launchers)"),
    Flag("result-file", "write the round's JSON summary here"),
)

WORKER_FLAGS: tuple[Flag, ...] = (
    Flag("chief", "the chief's HOST:PORT"),
    Flag("devices", "local devices, one replica each", default="cpu:0"),
    Flag("worker-id", "this worker's id; default HOSTNAME-PID"),
    Flag("rank", "preferred rank (the chief gives another if it is taken)", int, -1),
    Flag("token", "the cluster token", parse=token_text),
    *tls_flags(worker=True),
    Flag("shm", "map the arena of the chief or of this host's receiving worker through shared memory when on "
         "their host (--no-shm: network only)", parse_bool, True, boolean=True),
    Flag("expect-model", "refuse to join unless the chief's variables match this model's (preset, spec, .npz, "
         ".safetensors; only names, shapes, dtypes and modes are read)"),
    *timeout_flags("join", "stall", "start", "heartbeat"),
    Flag("log-format", "text or json", default="text", choices=("text", "json")),
)


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
