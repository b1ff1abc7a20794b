"""``collective bench sim``: fit the simulator (``collective.bench.sim``) to the emulated runs, then
project every topology to 64, 1,024 and 10,000 hosts at 25 and 100 Gbit/s, for 64 MiB and 10 GiB.

The fit: ``emulated_runs.json`` (beside this file) holds the medians of emulated-host runs, each
set with the command that produced it. The simulator's inputs are fitted to all of them at once,
least squares on the relative error: the links' payload ``efficiency`` and the per-chunk cost
(one input: the simulator adds the hop latency and the per-chunk cost as a sum, so their split
cannot be seen), each on a grid, and the round's fixed seconds in closed form for each point. Each
run is printed beside the simulator's figure and ``topology.predict``'s (given the same link rate
x efficiency and per-hop seconds, plus the fixed seconds), with the errors.

The projection keeps the fitted per-chunk cost (a relay in Python on 2 cores shared by every
emulated host's processes), and beside it the relay's own cost measured with a core to itself
(``MEASURED_HOP_SECONDS``, ``collective bench hops``). Links are taken at their full rate (efficiency 1: header
overhead slows every topology alike) with no fixed seconds, so ``x S/B`` is the layout's own cost.

``--svg FILE`` draws time / (S/B) against hosts, one line per topology: solid, the projection
(25 Gbit/s, 64 MiB); dotted, the fitted simulator at the emulated setting (200 Mbit/s, 16 MiB);
points, the emulated runs (each over its own S/B). Hand-written SVG: no plotting library needed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from collective.bench.sim import Net, simulate
from collective.bench.spec import parse_rate
from collective.errors import UsageError
from collective.sizes import parse_size
from collective.topology import MODELLED, choose, predict

RUNS = Path(__file__).with_name("emulated_runs.json")
HOSTS = (64, 1024, 10_000)
RATES = (("25 Gbit/s", 25e9 / 8), ("100 Gbit/s", 100e9 / 8))
SIZES = (("64 MiB", 64 << 20), ("10 GiB", 10 << 30))
PLOT_HOSTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 10_000)
COLOURS = {"star": "#d62728", "tree": "#1f77b4", "chain": "#2ca02c", "dtree": "#9467bd"}
EMULATED_BURST = 256 << 10  # tbf's bucket on every emulated link (collective/bench/emulate.py: shape)
DEFAULT_QUEUE = "100ms"  # tbf's latency on every emulated link unless a set says otherwise
DEFAULT_BURST = "256kb"  # tbf's bucket on every emulated link unless a set says otherwise (EMULATED_BURST)
# The projection's second column: the relay's own cost per hop, measured with a core to itself
# (`collective bench hops --workers 8 --chunk-bytes C --size C --repeat 9`, C = 16 KiB .. 2 MiB: one
# chunk through a chain of relays on loopback, the slope of its arrival over the hops is 0.41 ms +
# 0.35 ms per MiB; the per-MiB part is the loopback's own copies, the wire the simulator charges on
# its own). What a hop costs on a 25 Gbit/s datacentre link is assumed to be this: the relay's
# wake-ups, digest and hand-off, with its transfer at the link's rate.
MEASURED_HOP_SECONDS = 0.00041


@dataclass(frozen=True)
class Run:
    topology: str
    hosts: int
    bytes: int
    bytes_per_second: float
    seconds: float

    @property
    def link_seconds(self) -> float:
        return self.bytes / self.bytes_per_second


def load_runs(path: Path = RUNS, *, queue: str = DEFAULT_QUEUE, burst: str = DEFAULT_BURST) -> list[Run]:
    """The runs of every set whose links had ``queue`` and ``burst`` (tbf's latency and bucket; a
    set without them had the emulation's defaults)."""
    data = json.loads(path.read_text())
    return [Run(topo, int(hosts), s["bytes"], parse_rate(s["rate"]) / 8, secs)
            for s in data["sets"] if (s.get("queue", DEFAULT_QUEUE), s.get("burst", DEFAULT_BURST)) == (queue, burst)
            for topo, by_hosts in s["seconds"].items() for hosts, secs in by_hosts.items()]


def other_queues(path: Path = RUNS) -> list[str]:
    """The shallower link queues some sets were run with (``collective bench --queue``)."""
    sets = json.loads(path.read_text())["sets"]
    return sorted({s["queue"] for s in sets if s.get("queue", DEFAULT_QUEUE) != DEFAULT_QUEUE},
                  key=lambda q: -float(q.rstrip("ms")))


def other_buckets(path: Path = RUNS) -> list[str]:
    """The other link buckets some sets were run with (``collective bench --burst``)."""
    sets = json.loads(path.read_text())["sets"]
    return sorted({s["burst"] for s in sets if s.get("burst", DEFAULT_BURST) != DEFAULT_BURST})


def bucket_text(net: Net) -> str:
    """The runs made with another link bucket against the fit (not refitted: a check of the
    bucket's model, ``topology.bucket_bytes``)."""
    rows = []
    for burst in other_buckets():
        size = parse_size(burst.replace("kb", "KiB").replace("mb", "MiB"))
        rows += [dict(r, burst=burst) for r in fit_rows(load_runs(burst=burst), replace(net, burst_bytes=size))]
    body = [[r["burst"], r["topology"], str(r["hosts"]), _size(r["bytes"]), f"{r['measured']:.3f}", f"{r['sim']:.3f}",
             _pct(r["sim"], r["measured"]), f"{r['predict']:.3f}", _pct(r["predict"], r["measured"])] for r in rows]
    return _table(["bucket", "topology", "hosts", "size", "measured s", "simulated s", "error", "predict s", "error"],
                  body)


def _error(runs: list[Run], net: Net) -> tuple[float, Net]:
    """The sum of squared relative errors with the best fixed seconds for ``net``, and that net."""
    sims = [simulate(r.topology, r.hosts, r.bytes, replace(net, bytes_per_second=r.bytes_per_second)) for r in runs]
    weights = [1 / r.seconds**2 for r in runs]
    # Never below zero: the ready reports and the round's setup take time.
    fixed = max(sum(w * (r.seconds - s) for r, s, w in zip(runs, sims, weights, strict=True)) / sum(weights), 0.0)
    err = sum(w * (s + fixed - r.seconds) ** 2 for r, s, w in zip(runs, sims, weights, strict=True))
    return err, replace(net, fixed_seconds=fixed)


def fit(runs: list[Run]) -> Net:
    """The simulator's inputs that fit ``runs`` best (see the module doc): a coarse grid, then a
    finer one around its best point."""
    best = (math.inf, Net(1.0))
    eff_step, cost_step = 0.01, 0.002
    centre = (0.95, 0.01)
    for _ in range(3):
        for i in range(-5, 6):
            for j in range(-5, 6):
                eff, cost = centre[0] + i * eff_step, centre[1] + j * cost_step
                if 0.5 < eff <= 1.0 and cost >= 0:
                    net = Net(1.0, efficiency=eff, chunk_seconds=cost, burst_bytes=EMULATED_BURST)
                    best = min(best, _error(runs, net), key=lambda b: b[0])
        centre = (best[1].efficiency, best[1].chunk_seconds)
        eff_step, cost_step = eff_step / 5, cost_step / 5
    return best[1]


def queue_text(runs: list[Run]) -> str:
    """The fit again on the runs made with each shallower link queue (``collective bench
    --queue``), beside the fit of the default-queue runs of the same topologies, hosts and size:
    how much of the fitted per-chunk cost is the emulated links' queueing."""
    lines = []
    for queue in other_queues():
        shallow = load_runs(queue=queue)
        same = {(r.topology, r.hosts, r.bytes) for r in shallow}
        deep = [r for r in runs if (r.topology, r.hosts, r.bytes) in same]
        for name, chosen in ([(DEFAULT_QUEUE, deep)] if not lines else []) + [(queue, shallow)]:
            net = fit(chosen)
            worst = max(abs(r["sim"] / r["measured"] - 1) for r in fit_rows(chosen, net))
            lines.append(f"queue {name:>6}: {len(chosen)} runs ({', '.join(sorted({r.topology for r in chosen}))}), "
                         f"per-chunk cost {net.chunk_seconds * 1e3:.2f} ms, efficiency {net.efficiency:.4f}, "
                         f"fixed {net.fixed_seconds:+.3f} s, largest error {worst * 100:.1f} %")
    return "\n".join(lines)


def fit_rows(runs: list[Run], net: Net) -> list[dict]:
    rows = []
    for r in runs:
        sim = simulate(r.topology, r.hosts, r.bytes, replace(net, bytes_per_second=r.bytes_per_second))
        rate = r.bytes_per_second * net.efficiency
        # The token bucket's head start (burst / rate) comes off each hop, as on a relay's link,
        # refilled while it waits (on a double tree's receiver, less one chunk: ``bucket_bytes``).
        model = predict(r.topology, r.hosts, r.bytes, bytes_per_second=rate, burst_bytes=net.burst_bytes,
                        hop_seconds=net.hop_seconds + net.chunk_seconds) + net.fixed_seconds
        rows.append({"topology": r.topology, "hosts": r.hosts, "bytes": r.bytes, "measured": r.seconds,
                     "link_seconds": r.link_seconds, "sim": sim, "predict": model})
    return rows


def projection_rows(net: Net) -> list[dict]:
    fast = replace(net, chunk_seconds=MEASURED_HOP_SECONDS, hop_seconds=0.0)
    rows = []  # "sim": with the fitted per-chunk cost; "sim_fast": with the measured one
    for rate_name, rate in RATES:
        for size_name, size in SIZES:
            for hosts in HOSTS:
                link = size / rate
                for topo in MODELLED:
                    row = {"rate": rate_name, "size": size_name, "hosts": hosts, "topology": topo, "link_seconds": link}
                    for key, n in (("sim", net), ("sim_fast", fast)):
                        row[key] = simulate(topo, hosts, size, Net(rate, hop_seconds=n.hop_seconds,
                                                                   chunk_seconds=n.chunk_seconds))
                    row["predict"] = predict(topo, hosts, size, bytes_per_second=rate,
                                             hop_seconds=net.hop_seconds + net.chunk_seconds)
                    row["auto"] = choose("auto", hosts, size)
                    rows.append(row)
    return rows


GOALS = ((64 << 20, 1.5), (10 << 30, 1.1))  # issue 31: dtree at 1,024 hosts, 25 Gbit/s, x S/B at most
BUDGET_CHUNKS = (512 << 10, 128 << 10)


def relay_budget(size: int, goal: float, chunk: int, *, hosts: int = 1024, rate: float = RATES[0][1]) -> float:
    """The largest per-chunk cost (seconds per hop) at which a double tree of ``hosts`` meets
    ``goal`` x S/B with ``chunk``-byte chunks: the simulated time grows linearly with it."""
    def at(cost: float) -> float:
        return simulate("dtree", hosts, size, Net(rate, chunk_seconds=cost), chunk_bytes=chunk)

    base = at(0.0)
    return (goal * size / rate - base) / ((at(1e-3) - base) / 1e-3)


def budget_text() -> str:
    parts = []
    for size, goal in GOALS:
        costs = ", ".join(f"{relay_budget(size, goal, c) * 1e3:.2f} ms with {c >> 10} KiB chunks" for c in BUDGET_CHUNKS)
        parts.append(f"dtree meets <= {goal}x S/B at 1,024 hosts, {_size(size)}, 25 Gbit/s while a hop costs at most {costs}")
    return "\n".join(parts)


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


def _pct(got: float, want: float) -> str:
    return f"{(got / want - 1) * 100:+.1f} %"


def _table(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table (it reads as plain text too)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def fit_text(rows: list[dict], net: Net) -> str:
    body = [[r["topology"], str(r["hosts"]), _size(r["bytes"]), f"{r['measured']:.3f}",
             f"{r['measured'] / r['link_seconds']:.2f}", f"{r['sim']:.3f}", _pct(r["sim"], r["measured"]),
             f"{r['predict']:.3f}", _pct(r["predict"], r["measured"])] for r in rows]
    worst = max(abs(r["sim"] / r["measured"] - 1) for r in rows)
    worst_p = max(abs(r["predict"] / r["measured"] - 1) for r in rows)
    return "\n".join([
        _table(["topology", "hosts", "size", "measured s", "x S/B", "simulated s", "error", "predict s", "error"], body),
        f"fitted: efficiency {net.efficiency:.4f}, per-chunk cost (hop latency + relay) {net.chunk_seconds * 1e3:.2f} ms, "
        f"fixed {net.fixed_seconds:+.3f} s; largest error: simulator {worst * 100:.1f} %, predict {worst_p * 100:.1f} %",
    ])


def projection_text(rows: list[dict], net: Net) -> str:
    body = []
    for r in rows:
        body.append([r["rate"], r["size"], f"{r['hosts']:,}", r["topology"] + (" (auto)" if r["auto"] == r["topology"] else ""),
                     f"{r['sim']:.4g}", f"{r['sim'] / r['link_seconds']:.2f}", f"{r['sim_fast'] / r['link_seconds']:.2f}",
                     f"{r['predict'] / r['link_seconds']:.2f}"])
    cost = (net.hop_seconds + net.chunk_seconds) * 1e3
    return "\n".join([
        _table(["link", "size", "hosts", "topology", "simulated s", "x S/B", f"x S/B, relay measured {MEASURED_HOP_SECONDS * 1e3:.2f} ms",
                "predict x S/B"], body),
        f"per-chunk cost {cost:.2f} ms (fitted to the emulated runs; measured with a core to itself: "
        f"{MEASURED_HOP_SECONDS * 1e3:.2f} ms); (auto): what `--topology auto` picks among the topologies users can pick",
        budget_text(),
    ])


def svg(rows: list[dict], runs: list[Run], net: Net) -> str:
    """time / (S/B) against hosts, both axes logarithmic (see the module doc)."""
    w, h, left, right, top, bottom = 720, 440, 64, 150, 30, 48
    x_max, y_max = 10_000, 10_000

    def x(hosts: float) -> float:
        return left + (w - left - right) * math.log10(hosts) / math.log10(x_max)

    def y(ratio: float) -> float:
        return top + (h - top - bottom) * (1 - math.log10(max(ratio, 1)) / math.log10(y_max))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="12">broadcast time / (S/B) against hosts: simulated (lines) and emulated (points)</text>']
    for e in range(5):
        v = 10**e
        out.append(f'<line x1="{x(v):.1f}" y1="{top}" x2="{x(v):.1f}" y2="{h - bottom}" stroke="#ddd"/>'
                   f'<text x="{x(v):.1f}" y="{h - bottom + 14}" text-anchor="middle">{v:,}</text>')
        out.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{w - right}" y2="{y(v):.1f}" stroke="#ddd"/>'
                   f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:,}x</text>')
    out.append(f'<text x="{(left + w - right) / 2}" y="{h - 10}" text-anchor="middle">hosts (one receiver each)</text>')
    for topo in MODELLED:
        colour = COLOURS[topo]
        proj = " ".join(f"{x(n):.1f},{y(r['sim'] / r['link_seconds']):.1f}" for n, r in rows if r["topology"] == topo)
        out.append(f'<polyline points="{proj}" fill="none" stroke="{colour}" stroke-width="2"/>')
        emul = []
        for n in (1, 2, 4, 8, 16):
            rate = 200e6 / 8
            t = simulate(topo, n, 16 << 20, replace(net, bytes_per_second=rate))
            emul.append(f"{x(n):.1f},{y(t / ((16 << 20) / rate)):.1f}")
        out.append(f'<polyline points="{" ".join(emul)}" fill="none" stroke="{colour}" stroke-dasharray="2,3"/>')
        for r in runs:
            if r.topology == topo:
                out.append(f'<circle cx="{x(r.hosts):.1f}" cy="{y(r.seconds / r.link_seconds):.1f}" r="3.5" '
                           f'fill="{colour}" fill-opacity="0.6"/>')
    legend = [(t, COLOURS[t], "") for t in MODELLED] + [
        ("25 Gbit/s, 64 MiB", "#444", ""), ("200 Mbit/s, 16 MiB", "#444", "2,3"), ("emulated 200 Mbit/s", "#444", "dot")]
    for i, (label, colour, dash) in enumerate(legend):
        ly = top + 14 + 18 * i
        lx = w - right + 12
        if dash == "dot":
            out.append(f'<circle cx="{lx + 12}" cy="{ly - 4}" r="3.5" fill="{colour}"/>')
        else:
            out.append(f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 24}" y2="{ly - 4}" stroke="{colour}" stroke-width="2"'
                       + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")
        out.append(f'<text x="{lx + 30}" y="{ly}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def plot_rows(net: Net) -> list[tuple[int, dict]]:
    """The projection's 25 Gbit/s, 64 MiB line at every plotted host count."""
    rate, size = RATES[0][1], SIZES[0][1]
    return [(n, {"topology": t, "link_seconds": size / rate,
                 "sim": simulate(t, n, size, Net(rate, hop_seconds=net.hop_seconds, chunk_seconds=net.chunk_seconds))})
            for n in PLOT_HOSTS for t in MODELLED]


def run_sim(args, say) -> int:
    """Fit, print both tables (or one JSON line with --json), and write ``--svg``."""
    runs = load_runs()
    if not runs:
        raise UsageError(f"{RUNS.name} lists no emulated runs to fit the simulator to")
    say(f"fitting the simulator to {len(runs)} emulated runs")
    net = fit(runs)
    fits = fit_rows(runs, net)
    say("projecting 64, 1,024 and 10,000 hosts")
    proj = projection_rows(net)
    if getattr(args, "svg", None):
        Path(args.svg).write_text(svg(plot_rows(net), runs, net))
        say(f"plot written to {args.svg}")
    if args.json:
        print(json.dumps({"fit": {"efficiency": net.efficiency, "chunk_seconds": net.chunk_seconds,
                                  "fixed_seconds": net.fixed_seconds}, "emulated": fits, "projection": proj}))
        return 0
    print("Emulated (200 Mbit/s) against the simulator and the time model (topology.predict):\n")
    print(fit_text(fits, net))
    if other_buckets():
        print("\nRuns with another link bucket, against the fit (not refitted):\n")
        print(bucket_text(net))
    if other_queues():
        print("\nThe same fit on runs with shallower link queues (tbf latency), beside the default's:\n")
        print(queue_text(runs))
    print("\nProjection (simulated; x S/B against one link carrying the model once):\n")
    print(projection_text(proj, net))
    return 0
