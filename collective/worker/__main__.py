"""``python -m collective.worker``: join the chief, receive and verify the variables, wait for start."""

from __future__ import annotations

import argparse
import logging
import sys

from collective import logs
from collective.config import (
    parse_address,
    timeouts_from_args,
    tls_from_args,
)
from collective.entry import run_main
from collective.options import worker_parser

log = logging.getLogger("worker")


build_parser = worker_parser  # the flags live in collective.options


def main(argv: list[str] | None = None) -> int:
    def go() -> int:
        from collective.clusterenv import apply_to_environ, role_mismatch

        # TF_CONFIG / torchrun variables become COLLECTIVE_* defaults, before the parser reads them.
        cluster = apply_to_environ("worker")
        args = build_parser().parse_args(argv)
        logs.configure("worker", fmt=args.log_format)
        if cluster is not None:
            log.info("cluster from %s", cluster.describe())
            warning = role_mismatch(cluster, "worker")
            if warning:
                log.warning("%s", warning)
        return _run(args)

    return run_main(go)


def _run(args: argparse.Namespace) -> int:
    from collective._api import join
    from collective.errors import UsageError

    if not args.chief:
        raise UsageError("the chief's address is required: pass --chief HOST:PORT or set COLLECTIVE_CHIEF")
    parse_address(args.chief, what="--chief")
    expected = None
    if args.expect_model:
        from collective.sources import load_source

        expected = load_source(args.expect_model).specs()
    result = join(
        args.chief,
        devices=args.devices,
        worker_id=args.worker_id,
        rank=args.rank,
        token=args.token,
        timeouts=timeouts_from_args(args),
        expected=expected,
        tls=tls_from_args(args),
        shm=args.shm,
    )
    result.log_started()
    return 0


if __name__ == "__main__":
    sys.exit(main())
