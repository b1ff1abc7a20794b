"""``python -m chief``: serve one broadcast round over gRPC and exit 0 once start is released."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from collective import logs
from collective.config import (
    add_max_model_bytes_option,
    add_option,
    add_timeout_options,
    add_tls_options,
    byte_size,
    parse_address,
    parse_bool,
    positive_int,
    timeouts_from_args,
    tls_from_args,
)
from collective.entry import run_main

log = logging.getLogger("chief")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m chief", description=__doc__)
    add_option(p, "workers", help="number of workers to wait for", type=positive_int, default=None)
    add_option(p, "model", help="model: preset name (mlp, transformer-100m), .yaml/.json spec, .npz or .safetensors", default="mlp")
    add_option(p, "seed", help="seed for initializer specs (overrides the spec's)", type=int, default=None)
    add_option(p, "bind", help="HOST:PORT to listen on; port 0 picks a free port", default="0.0.0.0:50051")
    add_option(p, "token", help="cluster token every worker must present", default=None)
    add_tls_options(p, worker=False)
    add_option(p, "shm", help="offer the arena to workers on this host through shared memory (--no-shm: network only)",
               type=parse_bool, default=True, action=argparse.BooleanOptionalAction)
    add_option(p, "topology", help="who receives from whom: auto (by hosts and size, see README), star, tree, chain",
               default="auto", choices=["auto", "star", "tree", "chain"])
    add_option(p, "chunk-bytes", help="bytes per data message; default 4 MiB, 512 KiB for a chain",
               type=byte_size("--chunk-bytes"), default=None)
    add_timeout_options(p, "join", "ready", "heartbeat")
    add_option(p, "log-format", help="text or json", default="text", choices=["text", "json"])
    add_max_model_bytes_option(p)
    add_option(p, "port-file", help="write the bound port here once serving (for launchers)", default=None)
    add_option(p, "result-file", help="write the round's JSON summary here", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    def go() -> int:
        from collective.clusterenv import apply_to_environ, role_mismatch

        # TF_CONFIG / torchrun variables become COLLECTIVE_* defaults, before the parser reads them.
        cluster = apply_to_environ("chief")
        args = build_parser().parse_args(argv)
        logs.configure("chief", fmt=args.log_format)
        if cluster is not None:
            log.info("cluster from %s", cluster.describe())
            warning = role_mismatch(cluster, "chief")
            if warning:
                log.warning("%s", warning)
        return _run(args)

    return run_main(go)


def _run(args: argparse.Namespace) -> int:
    from collective._api import run_chief
    from collective.errors import UsageError
    from collective.sources import load_source

    if args.workers is None:
        raise UsageError("the number of workers is required: pass --workers N or set COLLECTIVE_WORKERS")
    parse_address(args.bind, what="--bind")
    tls = tls_from_args(args)
    if tls.enabled:
        tls.server_credentials()  # refuse a half-configured TLS setup before loading a big model
    source = load_source(args.model, seed=args.seed)

    def on_listening(address: str, port: int) -> None:
        if args.port_file:
            tmp = Path(args.port_file + ".tmp")
            tmp.write_text(str(port))
            os.replace(tmp, args.port_file)

    run_chief(
        source, args.workers, bind=args.bind, token=args.token, tls=tls, timeouts=timeouts_from_args(args),
        shm=args.shm, topology=args.topology, chunk_bytes=args.chunk_bytes, on_listening=on_listening,
        result_file=args.result_file, max_model_bytes=args.max_model_bytes,
    )
    log.info("training started: %d workers hold identical variables", args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
