"""``python -m worker``: join the chief, receive and verify the variables, wait for start."""

from __future__ import annotations

import argparse
import logging
import sys

from collective import logs
from collective.config import (
    add_option,
    add_timeout_options,
    add_tls_options,
    parse_address,
    parse_bool,
    timeouts_from_args,
    tls_from_args,
)
from collective.entry import run_main

log = logging.getLogger("worker")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
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
    from collective.errors import UsageError
    from worker.api import join_cluster

    if not args.chief:
        raise UsageError("the chief's address is required: pass --chief HOST:PORT or set COLLECTIVE_CHIEF")
    parse_address(args.chief, what="--chief")
    expected = None
    if args.expect_model:
        from collective.sources import load_source

        expected = load_source(args.expect_model).specs()
    result = join_cluster(
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
