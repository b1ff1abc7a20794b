"""``collective bench updates``: every-step weight updates to live processes (issue 38, item 7).

One run measures, for a bf16 state of ``--bytes`` in ``--tensors`` tensors, ``--steps`` steps each
changing a share of the elements at uniformly random positions:

* state (a): ``--fraction`` (default 1%) of the elements changed per step;
* state (b) (unless ``--no-adamw``): the share AdamW changes per step in a small bf16 transformer
  (transformers' Qwen2 when installed, else a stand-in of its layout in plain torch; random
  tokens; measured first, at lr 1e-5 and 1e-6, and reported; (b) uses the lr 1e-5 figure, the
  mean over the steps after the first, where Adam's first step moves every element by about lr);
* state (c), one host only: nothing changed (the fixed cost of a step).

and for each, on one host and (``--emulate-hosts``) on emulated hosts with ``--rate`` links (default
1gbit: one publisher host and one host per subscriber, every link shaped both ways), with each of
``--subscribers`` (default 1,8), five rows, every one from processes of its own
(``collective.bench.updates_roles``):

* ``collective-delta``: ``publish(copy=True)`` then ``pub.update(state, step)`` per step; the
  subscribers ``collective.subscribe(into=...)`` and ``sub.apply()`` each step (applied in place
  and verified against the step's manifest by the call);
* ``collective-delta-tree``: the same with the subscribers in a binary tree, each serving what
  it applied (``serve=True, stripe=False, auto=True``, sources ``[parent, publisher]``), so the
  publisher's link carries about one delta a step;
* ``collective-fetch``: the same ``pub.update(state, step)`` (which serves each step in full
  too); once it is served each subscriber ``collective.fetch``-es the whole step into its arrays
  (``shm=False``: the stream another host gets), every chunk verified;
* ``gloo-broadcast``: ``torch.distributed.broadcast`` of the whole state (one flat tensor) from
  rank 0 over gloo, then each receiver hashes what it got and compares it with the step's digest;
* ``safetensors-delta``: TRL's sparse delta file: per changed tensor its changed elements'
  indices (int32) and values, ``safetensors.torch.save_file``; each subscriber downloads it from
  the publisher over HTTP, ``load_file``, writes the values in place and hashes its state.

Columns: the bytes on the publisher's link per step (one host: the publisher's own count of what
it sent — ``stats()['bytes_served']``, the gloo root's TCP sockets' acknowledged bytes
(``tcp_info``), the HTTP bodies; emulated hosts: its interface's transmitted bytes, everything
included), seconds per step (median over the
steps of: the publisher's send returning -> the last subscriber holding the verified step; and
the same from the send call's start, which counts the copy ``update`` takes too; "x faster than
fetch" compares the first), the publisher's delta-making seconds
(``pub.last_update["delta_seconds"]``: every tensor compared with the baseline copy and coded;
the diff and file write of the safetensors row) and peak RSS, the subscriber's apply+verify seconds (``apply``;
``fetch``; the hash after the broadcast; load, apply and hash of the file) and peak RSS (the
largest subscriber's). ``verified``: after every step every subscriber's whole state hashed equal
to the publisher's (checked outside the clock, as is the row's own check inside it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from collective.bench.spec import BenchError
from collective.errors import UsageError
from collective.sizes import format_bytes, parse_size

ROWS = ("collective-delta", "collective-delta-tree", "collective-fetch", "gloo-broadcast", "safetensors-delta")
KIND = {"collective-delta": "delta", "collective-delta-tree": "delta", "collective-fetch": "fetch",
        "gloo-broadcast": "gloo", "safetensors-delta": "file"}
DEFAULT_BYTES = "1GiB"
DEFAULT_RATE = "1gbit"
DEFAULT_SUBSCRIBERS = "1,8"
LRS = (1e-5, 1e-6)
SEED = 38
WAIT = 1800.0
_rows = itertools.count()


@dataclass
class Row:
    name: str
    subscribers: int
    bytes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    from_call: list[float] = field(default_factory=list)
    make: list[float] = field(default_factory=list)
    apply: list[float] = field(default_factory=list)
    pub_rss: float = 0.0
    sub_rss: float = 0.0
    verified: bool = False
    changed: list[int] = field(default_factory=list)
    skipped: str = ""


def measure_fraction(workdir: Path, say: Callable[[str], None]) -> dict:
    """Run the AdamW measurement in a process of its own; its ``result`` dict plus ``used``."""
    from collective.bench.emulate import Process

    argv = [sys.executable, "-m", "collective.bench.updates_roles", "fraction", "--steps", "4"]
    for lr in LRS:
        argv += ["--lr", str(lr)]
    p = Process("local", "fraction", argv, {**os.environ, "PYTHONUNBUFFERED": "1"}, workdir / "fraction.log", Path.cwd())
    try:
        got = json.loads(p.wait_for(r"result (\{.*\})", WAIT).group(1))
    finally:
        p.kill()
    per = got["per_step"]
    got["mean"] = {lr: statistics.mean(v[1:]) for lr, v in per.items()}
    got["used"] = got["mean"][str(LRS[0])]
    say(f"AdamW on {got['model']} ({got['parameters']} parameters): changed per step "
        + "; ".join(f"lr {lr}: " + ", ".join(f"{x:.4%}" for x in v) for lr, v in per.items()))
    return got


class Place:
    """This host, or emulated hosts (``pub``, ``sub-1`` ...) with shaped links."""

    def __init__(self, workdir: Path, rate: str | None, subscribers: int) -> None:
        self.workdir, self.rate, self.topology, self.serial = workdir, rate, None, 0
        if rate is not None:
            from collective.bench.emulate import Topology

            hosts = ["pub"] + [f"sub-{i + 1}" for i in range(subscribers)]
            self.topology = Topology(hosts, workdir / "net").__enter__()
            for h in hosts:
                self.topology.shape(h, rate)

    @property
    def pub_host(self) -> str:
        return self.address("pub")

    def address(self, host: str) -> str:
        return "127.0.0.1" if self.topology is None else self.topology.hosts[host].address

    def start(self, host: str, argv: list[str]):
        from collective.bench.emulate import ROOT, Process

        self.serial += 1
        name = f"{self.serial:03d}-{host}"
        if self.topology is not None:
            return self.topology.run(host, argv, name=name, env={"PYTHONPATH": str(ROOT)})
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return Process("local", name, argv, env, self.workdir / f"{name}.log", Path.cwd())

    def link_tx(self) -> int | None:
        return None if self.topology is None else self.topology.link_bytes("pub")["tx"]

    def close(self) -> None:
        if self.topology is not None:
            self.topology.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_row(place: Place, row: Row, cfg: dict) -> None:
    where = "one-host" if place.topology is None else "emulated"
    d = place.workdir / f"row-{next(_rows):03d}-{where}-{row.name}-{row.subscribers}"
    d.mkdir()
    kind = KIND[row.name]
    cfg = {**cfg, "subscribers": row.subscribers, "host": place.pub_host, "tree": row.name.endswith("-tree"),
           "sub_hosts": [place.address(f"sub-{i + 1}") for i in range(row.subscribers)]}
    if kind == "gloo":
        cfg["gloo"] = f"{place.pub_host}:{_free_port() if place.topology is None else 29500}"
    (d / "row.json").write_text(json.dumps(cfg))
    mod = [sys.executable, "-m", "collective.bench.updates_roles"]
    procs = []
    try:
        if kind == "gloo":
            pub = place.start("pub", [*mod, "gloo", "--dir", str(d), "--index", "0"])
            procs.append(pub)
            subs = [place.start(f"sub-{i + 1}", [*mod, "gloo", "--dir", str(d), "--index", str(i + 1)])
                    for i in range(row.subscribers)]
        else:
            pub = place.start("pub", [*mod, f"publisher-{kind}", "--dir", str(d)])
            procs.append(pub)
            subs = [place.start(f"sub-{i + 1}", [*mod, f"subscriber-{kind}", "--dir", str(d), "--index", str(i)])
                    for i in range(row.subscribers)]
        procs += subs
        _await(pub, r"(?m)^begin$", procs)
        tx0 = place.link_tx()
        (d / "go").touch()
        _await(pub, r"(?m)^end$", procs)
        tx1 = place.link_tx()
        (d / "finish").touch()
        p = json.loads(_await(pub, r"result (\{.*\})", procs))
        s = [json.loads(_await(x, r"result (\{.*\})", procs)) for x in subs]
    except AssertionError as exc:
        raise BenchError(f"{row.name} with {row.subscribers} subscriber(s) failed (logs in {place.workdir}): "
                         f"{' | '.join(str(exc).splitlines()[:4])}") from None
    finally:
        for proc in procs:
            proc.kill()
    steps = cfg["steps"]
    row.bytes = p["bytes"] if tx0 is None else [(tx1 - tx0) // steps] * steps
    row.seconds = [max(x["held"][k] for x in s) - p["t0"][k] for k in range(steps)]
    row.from_call = [max(x["held"][k] for x in s) - p["call"][k] for k in range(steps)]
    row.make = [m for m in p["make"] if m is not None]
    row.apply = [max(x["apply"][k] for x in s) for k in range(steps)]
    row.pub_rss, row.sub_rss = p["peak_rss_mib"], max(x["peak_rss_mib"] for x in s)
    row.verified = all(all(x["verified"]) for x in s) and all(len(x["verified"]) == steps for x in s)
    row.changed = p["changed"]


def _await(proc, pattern: str, procs: list) -> str:
    """What ``pattern`` (with a group: that group) matched in ``proc``'s output; fails as soon as
    any of ``procs`` exited non-zero (a subscriber that died leaves the publisher waiting)."""
    from collective.bench.emulate import HostProcessError

    deadline = time.monotonic() + WAIT
    rx = re.compile(pattern)
    while True:
        m = rx.search(proc.output())
        if m:
            return m.group(m.lastindex or 0)
        for p in procs:
            if p.returncode not in (None, 0):
                tail = "\n".join(p.output().splitlines()[-3:])
                raise HostProcessError(f"{p.name} on {p.host} exited {p.returncode}: {tail}")
        if proc.returncode is not None or time.monotonic() > deadline:
            raise HostProcessError(f"{proc.name} on {proc.host} did not print {pattern!r}")
        time.sleep(0.02)


def delta_problem() -> str | None:
    import collective

    return None if hasattr(collective, "subscribe") else "collective.subscribe is not in this build"


def gloo_problem() -> str | None:
    from collective.bench.runners import torch_gloo_problem

    return torch_gloo_problem()


def table(rows: list[Row], size: int) -> str:
    from collective.bench.spec import aligned

    med = statistics.median
    fetch = {r.subscribers: med(r.seconds) for r in rows if r.name == "collective-fetch" and r.seconds}
    head = ["row", "subs", "link bytes/step", "% of state", "s/step", "min-max s", "s/step from call",
            "x faster than fetch",
            "pub make s", "pub peak RSS MiB", "sub apply+verify s", "sub peak RSS MiB", "verified"]
    out = [head]
    for r in rows:
        if r.skipped:
            out.append([r.name, str(r.subscribers), *["-"] * 10, f"skipped: {r.skipped}"])
            continue
        s, c, b = med(r.seconds), med(r.from_call), int(med(r.bytes))
        f = fetch.get(r.subscribers)
        out.append([r.name, str(r.subscribers), str(b), f"{100 * b / size:.2f}", f"{s:.4f}",
                    f"{min(r.seconds):.4f}-{max(r.seconds):.4f}", f"{c:.4f}", f"{f / s:.1f}" if f and s > 0 else "-",
                    f"{med(r.make):.4f}" if r.make else "-", f"{r.pub_rss:.0f}", f"{med(r.apply):.4f}",
                    f"{r.sub_rss:.0f}", "yes" if r.verified else "NO"])
    return "\n".join(aligned(out))


def settings(args: argparse.Namespace) -> dict:
    from collective.bench.spec import _positive, parse_rate, parse_workers

    size = parse_size(args.bytes or DEFAULT_BYTES, option="--bytes")
    tensors = _positive(args.tensors, "--tensors")
    if size % (2 * tensors) or size < 2 * tensors * 64:
        raise UsageError(f"--bytes {args.bytes}: a multiple of 2 x --tensors {tensors} bytes, "
                         "at least 64 bf16 elements per tensor")
    try:
        frac = float(args.fraction)
    except ValueError:
        raise UsageError(f"--fraction {args.fraction!r} is not a number such as 0.01") from None
    if not 0 < frac <= 0.5:
        raise UsageError(f"--fraction {args.fraction}: a share of the elements in (0, 0.5], such as 0.01")
    subs = parse_workers(args.subscribers or [DEFAULT_SUBSCRIBERS], option="--subscribers")
    rate = (args.rate or DEFAULT_RATE) if args.emulate_hosts else None
    if rate is not None:
        parse_rate(rate)
        if os.geteuid() != 0:
            raise UsageError("--emulate-hosts needs root (it creates network namespaces and shapes links with tc)")
    elif args.rate is not None:
        raise UsageError("--rate applies to emulated hosts; add --emulate-hosts")
    return {"bytes": size, "tensors": tensors, "fraction": frac, "subscribers": subs,
            "steps": _positive(args.steps, "--steps"), "rate": rate, "no_adamw": bool(args.no_adamw)}


def run_updates(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    s = settings(args)
    skip = {"collective-delta": delta_problem(), "gloo-broadcast": gloo_problem()}
    for name, why in skip.items():
        if why:
            say(f"{name}: skipped, {why}")
    workdir = Path(tempfile.mkdtemp(prefix="collective-bench-updates-"))
    command = "collective bench updates " + " ".join(sys.argv[sys.argv.index("updates") + 1:]) \
        if "updates" in sys.argv else "collective bench updates"
    states = [("a", s["fraction"], f"{s['fraction']:.2%} of the elements changed per step, uniformly at random")]
    report: dict = {"command": command, "bytes": s["bytes"], "tables": []}
    ok = False
    try:
        if not s["no_adamw"]:
            got = measure_fraction(workdir, say)
            report["adamw"] = got
            states.append(("b", got["used"], f"{got['used']:.2%} of the elements changed per step at random positions "
                                             f"(AdamW's share at lr {LRS[0]:g} on {got['model']})"))
        states.append(("c", 0.0, "nothing changed (the fixed cost of a step)"))
        places = [None] + ([s["rate"]] if s["rate"] else [])
        for rate in places:
            where = "one host" if rate is None else f"emulated hosts, {rate} links"
            place = Place(workdir, rate, max(s["subscribers"]))
            try:
                for label, frac, words in states:
                    if rate is not None and label == "c":
                        continue
                    cfg = {"bytes": s["bytes"], "tensors": s["tensors"], "fraction": frac, "steps": s["steps"],
                           "seed": SEED}
                    rows = []
                    for n in s["subscribers"]:
                        for name in ROWS:
                            row = Row(name, n)
                            if skip.get(name):
                                row.skipped = skip[name]
                            else:
                                run_row(place, row, cfg)
                                say(f"({label}) {where}: {name}, {n} subscriber(s): "
                                    f"{statistics.median(row.seconds):.4f} s/step, "
                                    f"{int(statistics.median(row.bytes))} bytes/step, verified {row.verified}")
                            rows.append(row)
                    title = (f"state ({label}): {format_bytes(s['bytes'])} bf16 in {s['tensors']} tensors, {words}; "
                             f"{where}; median of {s['steps']} steps")
                    text = table(rows, s["bytes"])
                    print(f"{title}\n$ {command}\n{text}\n", file=sys.stderr if args.json else sys.stdout, flush=True)
                    report["tables"].append({"state": label, "fraction": frac, "where": where, "rows": [
                        {"name": r.name, "subscribers": r.subscribers, "skipped": r.skipped or None,
                         "bytes": r.bytes, "seconds": r.seconds, "from_call": r.from_call, "make": r.make, "apply": r.apply,
                         "pub_rss_mib": r.pub_rss, "sub_rss_mib": r.sub_rss, "verified": r.verified,
                         "changed": r.changed} for r in rows]})
            finally:
                place.close()
        ok = True
    finally:
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"logs kept in {workdir}")
    if args.json:
        print(json.dumps(report), flush=True)
    return 0


def add_updates_options(p: argparse.ArgumentParser) -> None:
    """``collective bench updates``'s own options (``--emulate-hosts``, ``--rate``, ``--json`` are
    the bench's)."""
    p.add_argument("--bytes", default=None, metavar="BYTES",
                   help=f"with updates: the bf16 state's bytes (default {DEFAULT_BYTES})")
    p.add_argument("--tensors", default="16", metavar="T", help="with updates: tensors sharing them (default 16)")
    p.add_argument("--fraction", default="0.01", metavar="F",
                   help="with updates: state (a)'s share of elements changed per step (default 0.01)")
    p.add_argument("--subscribers", action="append", metavar="N",
                   help=f"with updates: subscriber counts, a comma list (default {DEFAULT_SUBSCRIBERS})")
    p.add_argument("--steps", default="3", metavar="S", help="with updates: steps per row (default 3)")
    p.add_argument("--no-adamw", action="store_true",
                   help="with updates: skip state (b) (the AdamW measurement of a small transformer)")
