"""``python -m collective.chief``: serve one broadcast round over gRPC and exit 0 once start is released."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

from collective.config import (
    parse_address,
    timeouts_from_args,
    tls_from_args,
)
from collective.options import chief_parser, role_main

log = logging.getLogger("chief")


build_parser = chief_parser  # the flags live in collective.options


def main(argv: list[str] | None = None) -> int:
    return role_main("chief", _run, argv)


def _run(args: argparse.Namespace) -> int:
    from collective._api import run_chief
    from collective.chief.round import load_source_reporting
    from collective.errors import UsageError
    from collective.transport.grpc import server_credentials

    if args.workers is None:
        raise UsageError("the number of workers is required: pass --workers N or set COLLECTIVE_WORKERS")
    parse_address(args.bind, what="--bind")
    tls = tls_from_args(args)
    if tls.enabled:
        server_credentials(tls)  # refuse a half-configured TLS setup before loading a big model
    if args.port_file and os.path.exists(args.port_file) and not os.path.isfile(args.port_file):
        # It is replaced by a regular file: /dev/full would be gone, a FIFO's reader never told.
        raise UsageError(f"--port-file {args.port_file}: is not a regular file; name a file the chief may replace")

    def on_listening(address: str, port: int) -> None:
        if args.port_file:
            tmp = Path(args.port_file + ".tmp")
            try:
                tmp.write_text(str(port))
                os.replace(tmp, args.port_file)
            except OSError as exc:  # a full disk, a missing directory: the user's to fix, not a bug
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise UsageError(f"--port-file {args.port_file}: cannot write it: {exc.strerror or exc}") from exc

    run_chief(
        # Loaded once the port is bound: a port in use is reported first, and a model that cannot
        # be loaded is the answer every worker's join gets.
        lambda: load_source_reporting(args.model, seed=args.seed, result_file=args.result_file, transport="grpc"),
        args.workers, bind=args.bind, token=args.token, tls=tls, timeouts=timeouts_from_args(args),
        shm=args.shm, topology=args.topology, chunk_bytes=args.chunk_bytes, on_listening=on_listening,
        result_file=args.result_file, max_model_bytes=args.max_model_bytes, shards=args.shards,
        from_file=args.from_file,
    )
    log.info("training started: %d workers hold %s", args.workers,
             "their shards" if args.shards is not None else "identical variables")
    return 0


if __name__ == "__main__":
    sys.exit(main())
