"""Run ``collective.mpi`` under mpiexec with test probes (test-only; never shipped).

PROBE_CORRUPT_RANK=r   MPI rank r flips one bit of the first data chunk it receives.
PROBE_CRASH_RANK=r     MPI rank r raises a RuntimeError (a bug, not a CollectiveError) at its
                       first data chunk: the ranks are out of step and the job must abort.
PROBE_HOLD_RANK=r      MPI rank r prints HOLDING and sleeps 60 s before joining (the others wait).
PROBE_LATE_SIGNAL=r:s  MPI rank r runs its SIGINT / SIGTERM handler s seconds late, as a rank that a
                       loaded machine schedules late does.
PROBE_BCAST_LOG=path   rank 0 writes the largest byte count it passed to one Bcast call of the
                       data stream (control messages such as the plan are not counted).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpi4py import MPI  # noqa: E402

from collective import mpi as entry  # noqa: E402
from collective.transport import mpi as transport  # noqa: E402


class _CountingComm:
    def __init__(self, comm, log_path):
        self._comm, self._log, self.largest, self.streaming = comm, log_path, 0, False

    def Bcast(self, buf, root=0):  # noqa: N802 - MPI's name
        if self.streaming:
            self.largest = max(self.largest, buf[0].nbytes)
        with open(self._log, "w") as fh:
            fh.write(str(self.largest))
        return self._comm.Bcast(buf, root=root)

    def __getattr__(self, name):
        return getattr(self._comm, name)


if os.environ.get("PROBE_BCAST_LOG") and MPI.COMM_WORLD.rank == 0:
    real_init = transport.MpiChiefDriver.__init__

    def counting_init(self, comm, *args, **kwargs):
        real_init(self, _CountingComm(comm, os.environ["PROBE_BCAST_LOG"]), *args, **kwargs)

    real_stream = transport.MpiChiefDriver._stream

    def counting_stream(self):
        self.comm.streaming = True
        try:
            return real_stream(self)
        finally:
            self.comm.streaming = False

    transport.MpiChiefDriver.__init__ = counting_init
    transport.MpiChiefDriver._stream = counting_stream

def _probe_rank(name: str) -> bool:
    return bool(os.environ.get(name)) and MPI.COMM_WORLD.rank == int(os.environ[name])


if _probe_rank("PROBE_CORRUPT_RANK") or _probe_rank("PROBE_CRASH_RANK"):
    real_receive = transport.MpiChiefLink.receive_into
    crash = _probe_rank("PROBE_CRASH_RANK")

    class _Receiver:
        """Around the worker's receiver: at the first chunk, flips one bit of its bytes after they
        landed, before they are checked (corrupt), or raises a bug (crash)."""

        def __init__(self, receiver):
            self._r, self._first, self._last = receiver, True, None

        @property
        def plan(self):
            return self._r.plan

        def span(self, start, end):
            self._last = self._r.span(start, end)
            return self._last

        def view(self, offset, nbytes):  # a shard's own stream, chunk by chunk
            self._last = self._r.view(offset, nbytes)
            return self._last

        def accept(self, chunk, placed=False):
            if crash:
                raise RuntimeError("probe: a bug in the middle of the data stream")
            if self._first and self._last is not None and len(self._last):
                self._last[0] ^= 0x10
                self._first = False
            return self._r.accept(chunk, placed=placed)

    def probed_receive(self, ref, receiver, stall_timeout):
        return real_receive(self, ref, _Receiver(receiver), stall_timeout)

    transport.MpiChiefLink.receive_into = probed_receive

if _probe_rank("PROBE_HOLD_RANK"):
    import time

    real_join = transport.MpiChiefLink.join

    def held_join(self, *args, **kwargs):
        print("HOLDING", flush=True)
        time.sleep(60)
        return real_join(self, *args, **kwargs)

    transport.MpiChiefLink.join = held_join

if os.environ.get("PROBE_LATE_SIGNAL"):
    import time

    late_rank, late_s = os.environ["PROBE_LATE_SIGNAL"].split(":")
    if MPI.COMM_WORLD.rank == int(late_rank):

        def late(handler):
            def run_late(signum, frame):
                time.sleep(float(late_s))
                handler(signum, frame)

            return run_late

        entry._on_interrupt, entry._on_terminate = late(entry._on_interrupt), late(entry._on_terminate)

sys.exit(entry.main())
