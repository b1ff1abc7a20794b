"""What every command-line entry point does with errors: one line, the right exit code.

A ``CollectiveError`` (a user mistake or a failed round) is logged as one line naming the
culprit, with exit code ``exc.exit_code`` (2 for usage and input errors) and no traceback.
Ctrl-C exits 130. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from collective.errors import CollectiveError

log = logging.getLogger("collective")


def run_main(main: Callable[[], int]) -> int:
    try:
        return main()
    except CollectiveError as exc:
        if logging.getLogger().handlers:
            log.error("%s", exc)
        else:
            print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
