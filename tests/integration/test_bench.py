"""`collective bench`: the JSON it prints, its peers, and its refusals. No timing is asserted:
only that every figure is a positive time of the asked-for bytes and workers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from collective.bench import (
    Candidate,
    candidates,
    parse_rate,
    parse_size,
    parse_workers,
    variable_lengths,
    write_spec,
)
from collective.errors import UsageError
from tests.framework.conftest import require
from tests.procs import ROOT

# One deadline for a bench run and pytest's timeout consistent with it. Beside three CPU-bound
# processes a 1 MiB bench with its peers overran 90 s, a refusal 30 s (its imports), `bench sim`
# in-process pytest's 120 s, and --recovery's 180 s wait was cut at pytest's 120 s.
RUN = 300
pytestmark = [pytest.mark.integration, pytest.mark.timeout(RUN + 60)]

MIB = 1 << 20
SMALL = ["--workers", "2", "--size", "1MiB", "--variables", "4", "--repeat", "1"]
STAR = ["--topology", "star"]  # one project run per test (star exists with or without relay topologies)


def bench(*args: str, timeout: float = RUN, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
    return subprocess.run([*prefix, sys.executable, "-m", "collective.cli", "bench", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env, stdin=subprocess.DEVNULL)


def one_json_line(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout  # the table and progress go to stderr with --json
    return json.loads(lines[0])


def check_entry(entry: dict, *, workers: int, size: int) -> None:
    assert set(entry) == {"name", "path", "workers", "bytes", "seconds"}, entry
    assert entry["path"] in ("mapped", "network", "net-tcp", "net-grpc", "mpi", "peer"), entry
    assert isinstance(entry["name"], str) and entry["name"]
    assert entry["workers"] == workers and entry["bytes"] == size
    assert isinstance(entry["seconds"], float) and entry["seconds"] > 0, entry


def test_json_has_one_result_per_project_topology_with_the_asked_bytes_and_workers():
    out = one_json_line(bench(*SMALL, "--json"))
    assert set(out) == {"results", "link_seconds"} and out["link_seconds"] is None
    # every topology launch offers; no peers unless asked
    assert [e["name"] for e in out["results"]] == ["star", "tree", "chain", "dtree"]
    for entry in out["results"]:
        check_entry(entry, workers=2, size=MIB)


@pytest.mark.mpi
def test_peers_add_a_bare_mpi_bcast_of_the_same_bytes_and_gloo_or_the_reason_it_is_skipped():
    proc = bench(*SMALL, *STAR, "--peers", "--json")
    out = one_json_line(proc)
    names = [e["name"] for e in out["results"]]
    assert names.count("mpi-bcast") == 1, names
    for entry in out["results"]:
        check_entry(entry, workers=2, size=MIB)
    if "gloo" not in names:
        assert "gloo: torch not installed" in proc.stderr or "gloo:" in proc.stderr, proc.stderr
    # The table (on stderr with --json) gives every result a ratio to the best peer.
    assert "x best peer" in proc.stderr and "mpi-bcast" in proc.stderr


@pytest.mark.mpi
def test_the_mpi_transport_is_reported_as_mpi():
    out = one_json_line(bench(*SMALL, "--transport", "mpi", "--json"))
    assert [e["name"] for e in out["results"]] == ["mpi"]
    check_entry(out["results"][0], workers=2, size=MIB)


def test_without_json_it_prints_a_table():
    proc = bench("--workers", "1", "--size", "64KiB", "--variables", "2", "--repeat", "1", *STAR)
    assert proc.returncode == 0, proc.stderr
    header, rule, *rows = proc.stdout.splitlines()
    assert header.split()[:6] == ["name", "path", "workers", "bytes", "median", "s"], proc.stdout
    table_rows = [row for row in rows if not row.startswith(("path ", "inside the clock"))]
    assert table_rows and all(row.split()[1:4] == ["mapped", "1", str(64 << 10)] for row in table_rows), proc.stdout
    assert any(row.startswith("inside the clock") for row in rows), proc.stdout


def test_the_copy_free_path_is_never_given_a_ratio_to_the_copying_peers():
    from collective.bench import Result, table

    results = [
        Result("chain", 4, MIB, [0.1], path="mapped"),
        Result("chain", 4, MIB, [0.8], path="network"),
        Result("gloo", 4, MIB, [0.4], peer=True, path="peer"),
    ]
    lines = table(results, None).splitlines()
    mapped, network, gloo = (line.split() for line in lines[2:5])
    assert mapped[1] == "mapped" and mapped[-1] == "-"  # no "x best peer" for a path that copies nothing
    assert network[1] == "network" and network[-1] == "2.00"
    assert gloo[-1] == "1.00"
    notes = "\n".join(lines[5:])
    assert "path mapped: shared memory" in notes and "no byte is copied" in notes
    assert "inside the clock" in notes and "Outside for both" in notes


@pytest.mark.parametrize("data_path, path", [("tcp", "net-tcp"), ("grpc", "net-grpc")])
def test_the_network_path_can_be_pinned_to_tcp_or_grpc_and_says_so(data_path, path):
    out = one_json_line(bench(*SMALL, *STAR, "--no-shm", "--data-path", data_path, "--json"))
    [entry] = out["results"]
    check_entry(entry, workers=2, size=MIB)
    assert entry["path"] == path


@pytest.mark.parametrize("args, says", [
    (["--size", "0"], "--size"),
    (["--workers", "0"], "--workers"),
    (["--workers", "2,0"], "--workers"),
    (["--variables", "0"], "--variables"),
    (["--topology", "no-such-topology"], "unknown topology 'no-such-topology'"),
    (["--transport", "carrier-pigeon"], "--transport"),
    (["--rate", "200mbit"], "--emulate-hosts"),
    (["--data-path", "pigeon"], "--data-path 'pigeon' is not one of auto, tcp, grpc"),
    (["--chunk-bytes", "0"], "--chunk-bytes"),
    (["scale", "--per-process", "0"], "--per-process must be at least 1"),
    (["--queue", "5ms"], "--queue applies to emulated hosts"),
    (["--burst", "1mb"], "--burst applies to emulated hosts"),
    (["hops", "--workers", "1"], "needs --workers 2 or more"),
    (["hops", "--data-path", "grpc"], "--data-path 'grpc': use tcp"),
    (["hops", "--topology", "star"], "--topology 'star': use chain or dtree"),
    (["scale", "--lease", "soon"], "--lease 'soon' is not a number of seconds"),
])
def test_bad_options_exit_2_with_one_line_and_no_traceback(args, says):
    proc = bench(*args, "--json")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_emulated_hosts_need_root(monkeypatch, capsys):
    """In-process, as if not root: exit 2 with one line (a separate non-root user could not
    even read a checkout in a private temporary directory, as CI's may be)."""
    from collective.cli import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    code = main(["bench", "--emulate-hosts", "--workers", "1", "--size", "1MiB", "--repeat", "1", "--json"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "needs root" in lines[0], err


@pytest.mark.multihost
def test_emulated_hosts_report_link_seconds_and_every_figure(tmp_path):
    from collective.bench.emulate import unavailable_reason

    reason = unavailable_reason("emulated-hosts bench")
    if reason:
        pytest.skip(reason)
    out = one_json_line(bench("--emulate-hosts", "--rate", "200mbit", *SMALL, *STAR, "--json"))
    assert out["link_seconds"] == pytest.approx(MIB * 8 / 200e6, rel=1e-4)
    assert out["results"]
    for entry in out["results"]:
        check_entry(entry, workers=2, size=MIB)


def test_plot_draws_a_png_or_says_how_to_get_matplotlib(tmp_path):
    png = tmp_path / "bench.png"
    proc = bench("--workers", "1", "--size", "64KiB", "--variables", "1", "--repeat", "1", *STAR, "--plot", str(png))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert proc.returncode == 2 and "pip install matplotlib" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    else:
        assert proc.returncode == 0, proc.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the pieces, in process ------------------------------------------------------------------


def test_sizes_rates_and_worker_lists_parse():
    assert parse_size("256MiB") == 256 * MIB and parse_size("1MiB") == MIB and parse_size("20000KiB") == 20_480_000
    assert parse_size("64MB") == 64_000_000 and parse_size("1.5GiB") == 3 << 29 and parse_size("4096") == 4096
    assert parse_rate("200mbit") == 200e6 and parse_rate("1gbit") == 1e9 and parse_rate("25mbps") == 200e6
    assert parse_workers(["2,4", "8", "4"]) == [2, 4, 8]
    for bad in ("0", "-1", "1.5B", "12XB", ""):
        with pytest.raises(UsageError):
            parse_size(bad)
    with pytest.raises(UsageError):
        parse_rate("fast")


def test_the_model_spec_has_k_float32_variables_totalling_the_size(tmp_path):
    from collective.sources import load_source

    for size, k in ((MIB, 4), (20000 * 1024, 20000), (4 * 1000 + 8, 3), (64, 16)):
        lengths = variable_lengths(size, k)
        assert len(lengths) == k and 4 * sum(lengths) == size
    specs = load_source(str(write_spec(tmp_path / "m.yaml", MIB, 4))).specs()
    assert len(specs) == 4 and sum(s.nbytes for s in specs) == MIB
    assert {s.dtype for s in specs} == {"<f4"}
    with pytest.raises(UsageError):
        variable_lengths(10, 1)  # not whole float32s


def test_candidates_are_every_topology_but_auto_or_those_asked_and_mpi():
    assert candidates(["grpc", "mpi"], []) == [Candidate(n, "grpc", n) for n in ("star", "tree", "chain", "dtree")] + [
        Candidate("mpi", "mpi")]
    assert candidates(["grpc"], ["tree"]) == [Candidate("tree", "grpc", "tree")]
    with pytest.raises(UsageError, match="use one of: auto, star, tree, chain, dtree"):
        candidates(["grpc"], ["ring"])
    with pytest.raises(UsageError, match="applies to the grpc transport"):
        candidates(["mpi"], ["tree"])


def test_the_last_json_object_is_found_even_with_a_log_line_glued_to_it():
    from collective.bench.runners import _last_json

    text = 'noise\n{"ok": false}\n{"ok": true, "seconds": 1.5}2026-12-02T14:34:40Z INFO worker: started\nmore\n'
    assert _last_json(text, "ok") == {"ok": True, "seconds": 1.5}
    assert _last_json("nothing here", "ok") is None


def test_collective_bench_runs_from_the_package_alone(tmp_path):
    # What a wheel installs is collective/ and nothing beside it: the bench must come with it.
    site = tmp_path / "site"
    shutil.copytree(ROOT / "collective", site / "collective", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}, "PYTHONPATH": str(site)}
    code = ("import sys, collective.cli as cli; assert cli.__file__.startswith(sys.argv[1]), cli.__file__; "
            "sys.exit(cli.main(sys.argv[2:]))")
    proc = subprocess.run([sys.executable, "-c", code, str(site), "bench", "--help"], capture_output=True, text=True,
                          timeout=RUN, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "--workers" in proc.stdout and "--emulate-hosts" in proc.stdout, proc.stdout


def test_from_file_reports_read_broadcast_to_ready_and_the_chiefs_rss_for_both_rows():
    out = one_json_line(bench("--from-file", "--size", "2MiB", "--files", "2", "--workers", "2", "--repeat", "1",
                              "--json"))
    assert set(out) == {"from_file", "bytes", "workers", "shards", "cold", "shm"}
    assert (out["bytes"], out["workers"], out["shards"], out["cold"], out["shm"]) == (2 * MIB, 2, 2, False, True)
    assert set(out["from_file"]) == {"copy", "from-file"}
    for row in out["from_file"].values():
        assert set(row) == {"load_seconds", "seconds", "ready_seconds", "peak_rss_bytes"}
        assert all(v > 0 for v in row.values()), row


@pytest.mark.parametrize("args, says", [
    (["--workers", "2,3"], "--from-file runs one worker count"),
    (["--files", "0"], "--files must be at least 1"),
])
def test_from_file_bad_options_exit_2_with_one_line(args, says):
    proc = bench("--from-file", *args, "--json")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr


def test_sim_prints_the_fit_and_the_projection_and_draws_an_svg(monkeypatch, capsys, tmp_path):
    """`collective bench sim` in-process, on a smaller projection (the full one takes half a minute)."""
    import xml.etree.ElementTree as ET

    from collective.bench import simreport
    from collective.cli import main

    monkeypatch.setattr(simreport, "HOSTS", (64,))
    monkeypatch.setattr(simreport, "SIZES", (("64 MiB", 64 << 20),))
    monkeypatch.setattr(simreport, "PLOT_HOSTS", (1, 64))
    monkeypatch.setattr(simreport, "GOALS", ((64 << 20, 1.5),))
    svg = tmp_path / "sim.svg"
    assert main(["bench", "sim", "--svg", str(svg)]) == 0
    out = capsys.readouterr().out
    assert "| star | 8 | 64 MiB | 22.456 |" in out  # a recorded emulated run beside its figures
    for topo in ("star", "tree", "chain", "dtree"):
        assert f"| 25 Gbit/s | 64 MiB | 64 | {topo}" in out and f"| 100 Gbit/s | 64 MiB | 64 | {topo}" in out
    assert "fitted: efficiency" in out and "dtree meets <= 1.5x S/B at 1,024 hosts" in out
    lines = ET.parse(svg).getroot().findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 8  # per topology: the projection and the fitted emulated setting


@pytest.mark.parametrize("topology", ["chain", "dtree"])
def test_hops_times_relays_without_a_control_plane(topology):
    """`collective bench hops`: every relay lands every chunk (one per tree), the chain's later the
    further it is from the source."""
    got = one_json_line(bench("hops", "--workers", "3", "--topology", topology, "--repeat", "2", "--json"))
    trees = 2 if topology == "dtree" else 1
    assert (got["topology"], got["workers"], got["bytes"], got["chunk_bytes"], got["path"]) == (
        topology, 3, trees * 512 << 10, 512 << 10, "tcp")
    assert len(got["hop_samples"]) == 2 and got["hop_seconds"] > 0
    assert all(a > 0 for a in got["arrival_seconds"])
    if topology == "chain":
        assert got["arrival_seconds"][0] < got["arrival_seconds"][1] < got["arrival_seconds"][2]


def test_sim_takes_no_other_mode(capsys):
    from collective.cli import main

    assert main(["bench", "simulate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "collective bench 'simulate': the modes are 'sim' and 'scale'" in err[0], err


@pytest.mark.timeout(2 * RUN + 60)  # six rows, each a round of its own
def test_recovery_times_torchfts_transports_and_collectives_side_by_side():
    # Tiny state: only that every row ran, recovered the holders' bytes (the bench checks the
    # digests) and reports its time and memory.
    require("torchft")  # make test installs it: there a missing torchft fails, never skips
    out = one_json_line(bench("--recovery", "--size", "256KiB", "--variables", "4", "--repeat", "1", "--json",
                              timeout=2 * RUN))
    names = [r["name"] for r in out["results"]]
    assert names == ["torchft-http", "torchft-http-chunks8", "torchft-pg-gloo", "collective-1-holder",
                     "collective-3-holders", "collective-1-holder-copy"], out
    for r in out["results"]:
        assert r["bytes"] == 256 * 1024 and r["seconds"] > 0 and r["peak_rss_mib"] > 0, r
        assert r["path"] and r["runs"] == [r["seconds"]], r  # every run, and which path it took
    assert out["link_seconds"] is None
    assert set(out["floor_gib_s"]) == {"memcpy", "xxh3"} and min(out["floor_gib_s"].values()) > 0, out


def test_recovery_bad_options_exit_2_with_one_line():
    proc = bench("--recovery", "--size", "1000", "--variables", "3")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not a multiple of 4 x --variables 3" in lines[0], proc.stderr
