"""A launched worker that joins late: `collective launch` starts its workers itself, so a test
that needs the run to stay in its join phase (to ask its status, to interrupt it) holds one of
them back with a ``sitecustomize`` on PYTHONPATH, read by every Python the launch starts."""

from __future__ import annotations

import os
from pathlib import Path

SITECUSTOMIZE = """
import os, sys, time
if {module!r} in sys.orig_argv and {marker!r} in [*sys.orig_argv, "PMI_RANK=" + os.environ.get("PMI_RANK", "")]:
    deadline = time.monotonic() + {timeout}  # never held past this, whatever the test does
    open({hold!r} + ".reached", "w").close()  # the test may act now: this process is held
    try:
        while os.path.exists({hold!r}) and time.monotonic() < deadline:
            time.sleep(0.05)
    except KeyboardInterrupt:  # interrupted while held: end as the real process would
        print("interrupted", file=sys.stderr, flush=True)
        os._exit(130)
"""


def held_worker_env(tmp: Path, marker: str = "worker-1", module: str = "collective.worker",
                    timeout: float = 90) -> tuple[dict[str, str], Path]:
    """(environment for the launch, hold file): the process of ``module`` with ``marker`` in its
    arguments (a worker id; ``PMI_RANK=2`` for an MPI rank) waits before it even imports its
    module until the hold file is removed (or ``timeout`` s pass)."""
    site = tmp / "held-site"
    site.mkdir()
    hold = tmp / "hold"
    hold.write_text("held\n")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(module=module, marker=marker, timeout=timeout, hold=str(hold)))
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}, hold
