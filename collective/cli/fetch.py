"""``collective fetch``: a training state published at a step (``collective.publish``) into a
.safetensors or .npz file."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from collective.errors import CollectiveError, UsageError


def command(args: argparse.Namespace) -> int:
    """``collective fetch``: the state into a file; one line saying what came from where.
    SIGTERM (``timeout``, a scheduler) ends it in one line, exit 143, through ``_fetch_to_file``'s
    cleanup: the output's new file is removed, as for any failure (it was left behind)."""
    from collective._waits import stopped_from_the_start

    def fetch() -> int:
        return _fetch_to_file(args)

    fetch.__module__ = "collective"  # its line names "collective.fetch", run as a module or not
    return stopped_from_the_start(fetch)()


def _fetch_to_file(args: argparse.Namespace) -> int:
    import time

    from collective.config import tls_from_args
    from collective.outfile import OutputFile
    from collective.sizes import format_bytes
    from collective.snapshot import fetch, tree
    from collective.sources import save_npz, save_safetensors

    out = Path(args.out)
    if out.suffix not in (".safetensors", ".npz"):
        raise UsageError(f"--out {args.out}: write a .safetensors or a .npz file")
    tls = tls_from_args(args)
    target = OutputFile(out, what=f"--out {args.out}")  # checked (and its file made) before the fetch
    try:
        started = time.monotonic()
        got = fetch(args.sources, step=args.step, token=args.token, timeout=args.timeout,
                    stall_timeout=args.stall_timeout, tls=tls if tls.enabled else None)
        skeleton, arrays = tree.flatten(got)  # names as published (key paths), no copy
        if out.suffix == ".npz":
            save_npz(target, arrays)
        else:
            save_safetensors(target, arrays, {"collective.step": str(got.step), "collective.manifest": got.manifest_digest,
                                              "collective.structure": json.dumps(skeleton)})
    finally:
        target.discard()  # a fetch or write that failed leaves no file (after commit: nothing to do)
    from collective.snapshot.holder import cluster_token

    if cluster_token(args.token):
        for address in _tokenless(list(got.stats), tls if tls.enabled else None):
            print(f"collective fetch: warning: holder at {address} asks for no token: the token given was not needed "
                  f"and proves nothing about that holder, and anyone who can reach it can fetch its state; publish "
                  f"with a token (publish(token=) or COLLECTIVE_TOKEN)", file=sys.stderr)
    holders = ", ".join(f"{a} {format_bytes(s['bytes'])}" for a, s in got.stats.items())
    print(f"fetched step {got.step} ({len(arrays)} tensor{'' if len(arrays) == 1 else 's'}, "
          f"{format_bytes(got.total_bytes)}, manifest "
          f"{got.manifest_digest}) in {time.monotonic() - started:.2f} s from {holders} -> {out}")
    return 0


def _tokenless(addresses: list[str], tls) -> list[str]:
    """The holders at ``addresses`` that answer a call without a token (a Status): those that
    ask for none. One that cannot be asked (gone since the fetch) is not named."""
    from collective.transport.grpc import GrpcChiefLink

    out = []
    for address in addresses:
        link = GrpcChiefLink(address, token=None, tls=tls, name="holder")
        try:
            link.status(timeout=10.0, brief=True)
            out.append(address)
        except CollectiveError:
            pass  # AuthError: the token is required, as it should be; else gone since: nothing to say
        finally:
            link.close()
    return out
