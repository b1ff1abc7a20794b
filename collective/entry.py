"""What every command-line entry point does with errors: one line, the right exit code.

A ``CollectiveError`` (a user mistake or a failed round) is logged as one line naming the
culprit, with exit code ``exc.exit_code`` (2 for usage and input errors) and no traceback.
Ctrl-C exits 130, also when the process was started with SIGINT ignored (a background job of
a script, as CI and ``cmd &`` start it, inherits SIGINT as SIG_IGN, and Python keeps an
inherited SIG_IGN): a user's or a launcher's SIGINT must never be lost, so the entry point
installs Python's handler itself, as torchrun installs its own. A reader that closed our stdout (``| head``) ends us quietly with 141, as
SIGPIPE ends other tools. Anything else is a bug and keeps its traceback.
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


def run_main(main: Callable[[], int]) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
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
