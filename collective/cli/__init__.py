"""``collective``: launch a local cluster, ask a running chief for its status, merge a run's logs,
fetch a published training state, check this host.

One module per command beside this one (``launch``, ``status``, ``logs``, ``fetch``,
``doctor``), each with ``command(args)``; their options come from the one flag table
(``collective.options``)."""

from __future__ import annotations

import argparse
import json
import sys

from collective.config import Parser, add_flags, plain
from collective.entry import early_sigint, run_main
from collective.errors import CollectiveError
from collective.logs import configure as configure_logs
from collective.options import DOCTOR_FLAGS, FETCH_FLAGS, LAUNCH_FLAGS, LOGS_FLAGS, STATUS_FLAGS


def build_parser() -> argparse.ArgumentParser:
    # Parser (config): no abbreviations (`--devices 2` must not silently mean `--devices-per-worker
    # 2`); an unknown option gets its subcommand's usage and the option it most likely meant.
    p = Parser(prog="collective", description=plain(__doc__).split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"collective {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_flags(sub.add_parser("launch", help="run a chief and N workers on this machine, on loopback"), LAUNCH_FLAGS)
    add_flags(sub.add_parser("status", help="ask a running chief who has joined and who is being waited for"),
              STATUS_FLAGS)
    lg = sub.add_parser("logs", help="merge a run directory's logs into one timeline")
    lg.add_argument("run_dir", metavar="RUN_DIR", nargs="?", default=None, help="the run directory (or --run-dir DIR)")
    add_flags(lg, LOGS_FLAGS)
    add_flags(sub.add_parser("fetch", help="fetch a training state published at a step (collective.publish) into a "
                             "file"), FETCH_FLAGS)

    _bench_tools().add_bench_parser(sub)

    add_flags(sub.add_parser("doctor", help="pre-flight checks: versions, cluster env, and the path to a chief"),
              DOCTOR_FLAGS)
    return p


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("collective")
    except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return "(not installed)"


# The command modules beside this one become attributes of this package once imported
# (`collective.cli.logs` is `logs` here then), so no name here is one of theirs (configure_logs,
# not logs: tests/unit/test_options.py checks).


def main(argv: list[str] | None = None) -> int:
    def go() -> int:
        args = build_parser().parse_args(argv)
        if args.command != "launch" and early_sigint():  # launch acts on it, its JSON line printed
            raise KeyboardInterrupt
        if args.command in ("launch", "bench"):  # these show log lines of their own and of processes they run
            configure_logs("launch")
            return _run(args)
        try:
            return _run(args)
        except CollectiveError as exc:  # the command's own one-line error, not a log line of another role
            if args.command == "status" and args.json:
                print(json.dumps({"ok": False, "error": str(exc), "error_type": type(exc).__name__}))
            print(f"collective {args.command}: error: {exc}", file=sys.stderr)
            return exc.exit_code

    go.acts_on_early_sigint = True  # type: ignore[attr-defined]
    return run_main(go)


def _run(args: argparse.Namespace) -> int:
    """The command ``args`` names, its module imported only now (``collective status`` stays quick)."""
    if args.command == "launch":
        from collective.cli.launch import command
    elif args.command == "status":
        from collective.cli.status import command
    elif args.command == "logs":
        from collective.cli.logs import command
    elif args.command == "fetch":
        from collective.cli.fetch import command
    elif args.command == "doctor":
        from collective.cli.doctor import command
    else:
        command = _bench
    return command(args)


def _bench_tools():
    """``collective.bench``, the benchmark: part of the package, so ``collective bench`` works
    wherever ``collective`` is installed (its runs ask for root, tc, mpiexec or matplotlib only
    when a mode needs them, and say so)."""
    import collective.bench

    return collective.bench


def _bench(args: argparse.Namespace) -> int:
    return _bench_tools().run_bench(args)
