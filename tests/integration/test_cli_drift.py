"""What the commands print matches what they do: one usage under mpiexec, one summary table,
errors naming the option to change, counts that count."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.test_launch import _launch
from tests.integration.test_mpi import mpirun
from tests.procs import ROOT

pytestmark = pytest.mark.integration


@pytest.mark.mpi
def test_a_typo_under_mpiexec_prints_the_usage_once():
    proc = mpirun(3, "--modle", "mlp")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert out.count("usage: mpiexec -n N+1 python -m collective.mpi") == 1, out
    assert out.count("unrecognized arguments: --modle mlp") == 1, out


def test_the_mpi_help_names_every_kind_of_model():
    proc = subprocess.run([sys.executable, "-m", "collective.mpi", "--help"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint directory" in " ".join(proc.stdout.split())


@pytest.mark.mpi
def test_launch_over_mpi_prints_one_summary_table(tmp_path):
    proc = _launch(tmp_path / "run", "--transport", "mpi", "--workers", "2")  # rank 0's lines echoed too
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert out.count("collective: broadcast complete") == 1, out


def test_a_bad_chunk_size_names_the_option_and_the_chunk_count_leaves_out_the_end_message(tmp_path):
    proc = _launch(tmp_path / "bad", "--workers", "1", "--json", "--quiet", "--chunk-bytes", "2GiB")
    assert proc.returncode == 2, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["error"].startswith("--chunk-bytes 2147483648 must be between 1 and ")
    # mlp is 940,616 bytes: 4 chunks of 256 KiB (the last one short), then the stream's end message.
    proc = _launch(tmp_path / "good", "--workers", "1", "--chunk-bytes", "256KiB")
    assert proc.returncode == 0, proc.stderr
    assert "plan released (4 chunk(s) per worker" in (tmp_path / "good" / "chief.log").read_text()
