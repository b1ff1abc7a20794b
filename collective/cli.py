"""``collective``: launch a local cluster, ask a running chief for its status, merge a run's logs,
fetch a published training state, check this host."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from collective import logs
from collective.config import (
    Parser,
    add_option,
    add_timeout_options,
    add_tls_options,
    byte_size,
    parse_bool,
    plain,
    positive_float,
    positive_int,
    timeouts_from_args,
    token_text,
)
from collective.entry import early_sigint, run_main
from collective.errors import CollectiveError, UsageError
from collective.options import parse_shards
from collective.topology import TOPOLOGIES


def build_parser() -> argparse.ArgumentParser:
    # Parser (config): no abbreviations (`--devices 2` must not silently mean `--devices-per-worker
    # 2`); an unknown option gets its subcommand's usage and the option it most likely meant.
    p = Parser(prog="collective", description=plain(__doc__))
    p.add_argument("--version", action="version", version=f"collective {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    launch = sub.add_parser("launch", help="run a chief and N workers on this machine, on loopback")
    add_option(launch, "workers", help="number of workers", type=positive_int, default=2)
    add_option(launch, "transport", help="grpc (chief and workers on loopback) or mpi (mpiexec -n N+1)",
               default="grpc", choices=["grpc", "mpi"])
    add_option(launch, "devices-per-worker", help="devices (replicas) per worker", type=positive_int, default=1)
    add_option(launch, "model", help="preset (mlp, transformer-100m), .yaml/.json spec, .npz or .safetensors file, "
               "a *.safetensors.index.json or a checkpoint directory", default="mlp")
    add_option(launch, "seed", help="seed for initializer specs", type=int, default=None)
    add_option(launch, "token", help="cluster token (default: a random one per run)", type=token_text, default=None)
    add_option(launch, "run-dir", help="where each process's log, the summary and, while the run lasts, the status "
               "file go (default: a new temp dir, removed after a successful run); it must be this user's and not "
               "writable by others", default=None)
    launch.add_argument("--keep-run-dir", action="store_true",
                        help="keep the temporary run dir of a successful run too (a failed run's is always kept)")
    add_option(launch, "chunk-bytes", help="bytes per data message, e.g. 1MiB; default 4 MiB, 512 KiB for a chain or dtree",
               type=byte_size("--chunk-bytes"), default=None)
    add_timeout_options(launch, "join", "ready", "start", "heartbeat")
    add_option(launch, "topology", help="who receives from whom (gRPC): auto, star, tree, chain, dtree",
               default="auto", choices=list(TOPOLOGIES))
    add_option(launch, "shm", help="same-host workers take the arena through shared memory (--no-shm: network only)",
               type=parse_bool, default=True, action=argparse.BooleanOptionalAction)
    add_option(launch, "from-file", help="the chief serves a .safetensors model straight from its file(s), mapped "
               "read-only, not a copy in memory (same-host workers map the files)", type=parse_bool, default=False,
               action=argparse.BooleanOptionalAction)
    add_option(launch, "shards", help="each worker receives a part of the model, not a replica: dim0 (torch's Shard(0) "
               "of every variable over the workers) or a JSON object name -> \"dim0\" / \"all\" / rank(s), \"*\" for "
               "the rest", type=parse_shards, default=None)
    launch.add_argument("--json", action="store_true", help="print the summary as one JSON line last")
    launch.add_argument("--quiet", action="store_true", help="do not echo the processes' log lines")

    status = sub.add_parser("status", help="ask a running chief who has joined and who is being waited for")
    add_option(status, "chief", help="the chief's HOST:PORT", default=None)
    add_option(status, "token", help="the cluster token", type=token_text, default=None)
    status.add_argument("--run-dir", default=None, help="the run dir of a running `collective launch`: its chief's "
                        "address and token are read from its status.json")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument("--watch", action="store_true", help="redraw every second until start or failure")

    lg = sub.add_parser("logs", help="merge a run directory's logs into one timeline")
    lg.add_argument("run_dir", metavar="RUN_DIR", nargs="?", default=None)
    lg.add_argument("--run-dir", dest="run_dir_option", metavar="DIR", default=None,
                    help="RUN_DIR given as an option, as `collective status --run-dir` takes it")
    lg.add_argument("--worker", default=None, help="only this worker: id (worker-1) or rank (1)")
    lg.add_argument("--phase", default=None,
                    help="only this phase (join, broadcast, receive, verify, ready, start, started, failed)")
    lg.add_argument("--json", action="store_true", help="one JSON object per line")

    fe = sub.add_parser("fetch", help="fetch a training state published at a step (collective.publish) into a file")
    fe.add_argument("--from", dest="sources", required=True, metavar="ADDR[,ADDR]",
                    help="the holders' HOST:PORT, comma-separated: the fetch is striped over them")
    fe.add_argument("--step", type=int, required=True, help="the step to fetch")
    fe.add_argument("--out", required=True, help="FILE.safetensors (the non-tensor values in its __metadata__) "
                    "or FILE.npz (tensors only)")
    add_option(fe, "token", help="the cluster token", type=token_text, default=None)
    fe.add_argument("--timeout", type=positive_float, default=300.0, help="seconds for the whole fetch")
    fe.add_argument("--stall-timeout", type=positive_float, default=30.0,
                    help="seconds a holder may send nothing before its share goes to the others")
    add_tls_options(fe, worker=True)

    _bench_tools().add_bench_parser(sub)

    dr = sub.add_parser("doctor", help="pre-flight checks: versions, cluster env, and the path to a chief")
    add_option(dr, "chief", help="the chief's HOST:PORT", default=None)
    add_option(dr, "token", help="the cluster token", type=token_text, default=None)
    add_tls_options(dr, worker=True)
    dr.add_argument("--timeout", type=positive_float, default=3.0, help="seconds per network check")
    dr.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument("--interval", type=float, default=1.0, help="seconds between redraws with --watch")
    return p


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("collective")
    except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    def go() -> int:
        args = build_parser().parse_args(argv)
        if args.command != "launch" and early_sigint():  # launch acts on it, its JSON line printed
            raise KeyboardInterrupt
        command = {"launch": _launch, "status": _status, "logs": _logs, "doctor": _doctor, "bench": _bench,
                   "fetch": _fetch}[args.command]
        if args.command in ("launch", "bench"):  # these show log lines of their own and of processes they run
            logs.configure("launch")
            return command(args)
        try:
            return command(args)
        except CollectiveError as exc:  # the command's own one-line error, not a log line of another role
            if args.command == "status" and args.json:
                print(json.dumps({"ok": False, "error": str(exc), "error_type": type(exc).__name__}))
            print(f"collective {args.command}: error: {exc}", file=sys.stderr)
            return exc.exit_code

    go.acts_on_early_sigint = True  # type: ignore[attr-defined]
    return run_main(go)


def _launch(args: argparse.Namespace) -> int:
    from collective.launch import Launcher, exit_code
    from collective.summary import summary_table

    launcher = None
    try:
        if early_sigint():  # a Ctrl-C while the command loaded
            raise KeyboardInterrupt
        launcher = Launcher(
            workers=args.workers,
            devices_per_worker=args.devices_per_worker,
            model=args.model,
            seed=args.seed,
            token=args.token,
            run_dir=args.run_dir,
            timeouts=timeouts_from_args(args),
            chunk_bytes=args.chunk_bytes,
            quiet=args.quiet,
            transport=args.transport,
            shm=args.shm,
            topology=args.topology,
            from_file=args.from_file,
            shards=args.shards,
            keep_run_dir=args.keep_run_dir,
        )
        result = launcher.run()
    except KeyboardInterrupt:
        if launcher is None:
            print("interrupted before the launch started: nothing was started", file=sys.stderr)
            if args.json:
                print(json.dumps(_not_started(args, "interrupted (SIGINT) before the launch started: nothing was "
                                                    "started", 130)))
            return 130
        where = launcher.run_dir
        print(f"interrupted: every process of the run was stopped; its logs are in {where} "
              f"(collective logs {where})", file=sys.stderr)
        if args.json:
            print(json.dumps(launcher.interrupted_summary()))
        return 130
    except CollectiveError as exc:  # refused before any process started (the run dir, the host's memory)
        if args.json:
            print(json.dumps(_not_started(args, exc, exc.exit_code)))
        raise
    print(summary_table(result, expected=args.workers), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return exit_code(result)


def _bench_tools():
    """``collective.bench``, the benchmark: part of the package, so ``collective bench`` works
    wherever ``collective`` is installed (its runs ask for root, tc, mpiexec or matplotlib only
    when a mode needs them, and say so)."""
    import collective.bench

    return collective.bench


def _bench(args: argparse.Namespace) -> int:
    return _bench_tools().run_bench(args)


def _logs(args: argparse.Namespace) -> int:
    from collective.logmerge import logs_command

    run_dir = args.run_dir or args.run_dir_option
    if not run_dir:
        raise UsageError("pass the run directory: collective logs RUN_DIR (or --run-dir DIR)")
    return logs_command(run_dir, worker=args.worker, phase=args.phase, as_json=args.json)


def _doctor(args: argparse.Namespace) -> int:
    from collective.config import tls_from_args
    from collective.doctor import doctor_command

    return doctor_command(args.chief, token=args.token, timeout=args.timeout, as_json=args.json,
                          tls=tls_from_args(args))


def _fetch(args: argparse.Namespace) -> int:
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


def _not_started(args: argparse.Namespace, error: object, code: int) -> dict:
    """``--json``'s summary line (every key of any other) of a launch that started nothing."""
    from collective.chief.reports import failed_summary

    summary = failed_summary(error, transport=args.transport, model=args.model)
    summary["exit_code"] = code
    return summary


def _status(args: argparse.Namespace) -> int:
    from collective.config import parse_address
    from collective.errors import ChiefUnreachableError
    from collective.status import run_of, status_dict, status_text, wait_for_outcome, watch
    from collective.transport.grpc import GrpcChiefLink

    run = None
    if args.run_dir:
        if args.chief:
            raise UsageError("pass either --run-dir or --chief, not both")
        run = run_of(args.run_dir)
        if run.address is None:  # the launch has ended: its summary says how
            return _ended(args, run.run_dir, run.result)
        args.chief = run.address
        args.token = args.token or run.token
    if not args.chief:
        from collective.clusterenv import from_environment

        env = from_environment(os.environ)
        args.chief = env.chief_address if env else None
    if not args.chief:
        raise UsageError("pass --chief HOST:PORT (or set COLLECTIVE_CHIEF), or --run-dir DIR of a running launch")
    parse_address(args.chief, what="--chief")
    link = GrpcChiefLink(args.chief, token=args.token)
    try:
        if args.watch and not args.json:
            st = watch(link, args.chief, interval=args.interval)
        else:
            st = link.status(timeout=5.0)
    except ChiefUnreachableError:
        if run is None:
            raise
        # A launch's chief ends soon after the outcome (it answers Status for a moment more):
        # launch then writes the summary into the run dir.
        return _ended(args, run.run_dir, wait_for_outcome(run))
    finally:
        link.close()
    if args.json:
        print(json.dumps(status_dict(st)))
    elif not args.watch:
        print(status_text(st, args.chief))
    return 1 if st.phase == "failed" else 0


def _ended(args: argparse.Namespace, run_dir: str, result: dict | None) -> int:
    """``collective status --run-dir`` of a launch whose chief is gone: its outcome, exit 0 when started."""
    from collective.status import outcome_dict, outcome_text

    shown = outcome_dict(run_dir, result)
    print(json.dumps(shown) if args.json else outcome_text(run_dir, result))
    return 0 if shown["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
