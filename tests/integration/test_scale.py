"""Many workers on one chief (issue 31, item 1): real processes over gRPC on loopback.

256 workers of the project's own worker code, 64 per process (``tools.bench.manyworkers``),
join one chief at once and complete a verified round: every worker started, every digest
equal. The chief's threads do not grow with the workers: before, its server had a pool thread
per open call (each worker holds three or four for the whole round: 770 threads at 256
workers); now calls are coroutines and waits are parked, so 16 workers and 256 take the same
few dozen. ``collective bench scale`` measures the same round at 1,024 (BENCHMARKS.md).
"""

from __future__ import annotations

import pytest

from tools.bench.scale import scale_round

pytestmark = pytest.mark.integration

# The chief's threads once start is released, whatever the number of workers: the gRPC loop and
# its pool (16), the parking thread, the supervisor, the raw data port's accept loops, gRPC's
# own. (While a star streams, the raw data port has a thread per stream: the data plane's.)
THREADS_ANY_N = 48


def test_256_workers_in_4_processes_complete_a_verified_round_with_the_threads_of_16(tmp_path):
    small = scale_round(16, 16, tmp_path / "n16", timeout=120, relay=False)
    assert small["ok"], small
    large = scale_round(256, 64, tmp_path / "n256", timeout=180, relay=False)
    assert large["ok"], large
    assert len(large["digests"]) == 1 and large["digests"] == small["digests"], (small, large)
    print(f"chief threads at the end: {small['chief_threads_end']} for 16 workers, {large['chief_threads_end']} "
          f"for 256 (peak {small['chief_threads']}, {large['chief_threads']}); round {large['round_s']:.1f} s, "
          f"admitted in {large['admitted_s']:.1f} s, status at most {large['status_max_s']:.2f} s, "
          f"peak RSS {large['chief_rss_mib']:.0f} MiB")
    assert 0 < small["chief_threads_end"] <= THREADS_ANY_N, small
    assert 0 < large["chief_threads_end"] <= THREADS_ANY_N, large
