"""What every command-line entry point does with errors: one line, the right exit code.

A ``CollectiveError`` (a user mistake or a failed round) is logged as one line naming the
culprit, with exit code ``exc.exit_code`` (2 for usage and input errors) and no traceback.
Ctrl-C exits 130, also when the process was started with SIGINT ignored (a background job of
a script, as CI and ``cmd &`` start it, inherits SIGINT as SIG_IGN, and Python keeps an
inherited SIG_IGN): a user's or a launcher's SIGINT must never be lost, so the entry point
installs Python's handler itself, as torchrun installs its own. The soft limit on open files
is raised to the hard one (``raise_fd_limit``). A reader that closed our stdout (``| head``)
ends us quietly with 141, as SIGPIPE ends other tools. Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

from collective.errors import CollectiveError

log = logging.getLogger("collective")


def raise_fd_limit() -> None:
    """Lift the soft limit on open files to the hard one, as Go programs do at start.

    A chief holds a few descriptors per worker (its gRPC connection, its data stream), and a
    server must outlast idle connections from strangers; 1,024, the usual soft default, is too
    few for either. The hard limit stays what the administrator set; capped at 2^20."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = min(hard if hard != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (OSError, ValueError):
        pass  # kept as it is: the servers cope with a short limit, only less well


_early_sigint: list[int] = []
ENTRY_MODULES = ("collective.chief", "collective.worker", "collective.cli", "collective.mpi")


def defer_sigint() -> None:
    """Called first thing by a ``python -m`` entry module, before its imports (a second or more
    on a loaded machine): a Ctrl-C in that time is held, not lost (a background job starts with
    SIGINT ignored) and not raised in the middle of an import as a traceback; ``run_main``
    acts on it as soon as it starts."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, lambda signum, frame: _early_sigint.append(signum))


def hold_sigint_while_starting() -> None:
    """``defer_sigint`` when this process is ``python -m collective.<command>`` still being
    located (runpy sets ``sys.argv[0]`` to the module's path only after importing its packages,
    so this is called from ``collective/__init__.py``). A library import does nothing."""
    argv = sys.orig_argv
    after_m = [a[2:] or b for a, b in zip(argv, [*argv[1:], ""], strict=True) if a.startswith("-m")]
    # Only the commands whose entry point acts on it (run_main, collective.mpi's main): any other
    # module run with -m would never see the Ctrl-C it held.
    if sys.argv[:1] == ["-m"] and after_m[:1] and after_m[0] in ENTRY_MODULES:
        defer_sigint()


def early_sigint() -> bool:
    """Whether a Ctrl-C came while the entry point loaded (``defer_sigint``)."""
    return bool(_early_sigint)


def run_main(main: Callable[[], int]) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    raise_fd_limit()
    try:
        # A Ctrl-C while the entry point loaded ends it here, unless ``main`` acts on it itself
        # once it knows its arguments (``collective launch --json``: a summary line even then).
        if _early_sigint and not getattr(main, "acts_on_early_sigint", False):
            raise KeyboardInterrupt
        code = main()
        sys.stdout.flush()  # here, not at exit, so a closed pipe is caught below
        return code
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush does not complain again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141
    except CollectiveError as exc:
        if logging.getLogger().handlers:
            log.error("%s", exc)
        else:
            print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
