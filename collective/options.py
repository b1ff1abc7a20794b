"""The command-line flags of ``python -m collective.chief`` and ``python -m collective.worker``, in one place below
both the entry points and the Python API (which reads its defaults from the same flags and
their ``COLLECTIVE_*`` variables), so neither imports the other.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from collective import logs
from collective.clusterenv import apply_to_environ, role_mismatch
from collective.config import (
    add_max_model_bytes_option,
    add_option,
    add_timeout_options,
    add_tls_options,
    byte_size,
    parse_bool,
    positive_int,
)
from collective.entry import run_main
from collective.topology import TOPOLOGIES

log = logging.getLogger("collective")

CHIEF_DESCRIPTION = '``python -m collective.chief``: serve one broadcast round over gRPC and exit 0 once start is released.'
WORKER_DESCRIPTION = '``python -m collective.worker``: join the chief, receive and verify the variables, wait for start.'


def chief_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m collective.chief`` (the Python API reads its defaults from them too)."""
    p = argparse.ArgumentParser(prog="python -m collective.chief", description=CHIEF_DESCRIPTION)
    add_option(p, "workers", help="number of workers to wait for", type=positive_int, default=None)
    add_option(p, "model", help="model: preset name (mlp, transformer-100m), .yaml/.json spec, .npz or .safetensors", default="mlp")
    add_option(p, "seed", help="seed for initializer specs (overrides the spec's)", type=int, default=None)
    add_option(p, "bind", help="HOST:PORT to listen on; port 0 picks a free port", default="0.0.0.0:50051")
    add_option(p, "token", help="cluster token every worker must present", default=None)
    add_tls_options(p, worker=False)
    add_option(p, "shm", help="offer the arena to workers on this host through shared memory (--no-shm: network only)",
               type=parse_bool, default=True, action=argparse.BooleanOptionalAction)
    add_option(p, "topology", help="who receives from whom: auto (by hosts and size, see README), star, tree, chain",
               default="auto", choices=list(TOPOLOGIES))
    add_option(p, "chunk-bytes", help="bytes per data message; default 4 MiB, 512 KiB for a chain",
               type=byte_size("--chunk-bytes"), default=None)
    add_timeout_options(p, "join", "ready", "heartbeat")
    add_option(p, "log-format", help="text or json", default="text", choices=["text", "json"])
    add_max_model_bytes_option(p)
    add_option(p, "port-file", help="write the bound port here once serving (for launchers)", default=None)
    add_option(p, "result-file", help="write the round's JSON summary here", default=None)
    return p


def worker_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m collective.worker`` (the Python API reads its defaults from them too)."""
    p = argparse.ArgumentParser(prog="python -m collective.worker", description=WORKER_DESCRIPTION)
    add_option(p, "chief", help="the chief's HOST:PORT", default=None)
    add_option(p, "devices", help="local devices, one replica each", default="cpu:0")
    add_option(p, "worker-id", help="this worker's id; default HOSTNAME-PID", default=None)
    add_option(p, "rank", help="preferred rank (the chief gives another if it is taken)", type=int, default=-1)
    add_option(p, "token", help="the cluster token", default=None)
    add_tls_options(p, worker=True)
    add_option(p, "shm", help="map the arena of the chief or of this host's receiving worker through shared memory when on their host (--no-shm: network only)",
               type=parse_bool, default=True, action=argparse.BooleanOptionalAction)
    add_option(p, "expect-model", help="refuse to join unless the chief's variables match this model's "
               "(preset, spec, .npz, .safetensors; only names, shapes, dtypes and modes are read)", default=None)
    add_timeout_options(p, "join", "stall", "start", "heartbeat")
    add_option(p, "log-format", help="text or json", default="text", choices=["text", "json"])
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
