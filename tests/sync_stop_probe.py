"""``tests/sync_rank.py`` with a SIGTERM that lands as ``collective.sync`` starts (test-only):
sent to this process from inside the call, before its roles are resolved, as a ``scancel`` in
the call's first half second lands before the chief's port is bound or the worker's relay is up.
The call then sleeps, so that a process the signal did not end on its own stays in that window."""

from __future__ import annotations

import os
import signal
import sys
import time

import sync_rank  # beside this file: the directory of the script run is first on sys.path

import collective._api as api

_resolve = api.resolve_roles


def _signalled(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5.0)  # a handler raises here at once; without one the process is gone
    return _resolve(*args, **kwargs)


if __name__ == "__main__":
    api.resolve_roles = _signalled
    sys.exit(sync_rank.main())
