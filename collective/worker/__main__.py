"""``python -m collective.worker``: join the chief, receive and verify the variables, wait for start."""

from __future__ import annotations

import argparse
import logging
import sys

from collective.config import (
    parse_address,
    timeouts_from_args,
    tls_from_args,
)
from collective.options import role_main, worker_parser

log = logging.getLogger("worker")


build_parser = worker_parser  # the flags live in collective.options


def main(argv: list[str] | None = None) -> int:
    return role_main("worker", _run, argv)


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
