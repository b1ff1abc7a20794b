"""``python -m collective.cli``: the ``collective`` command."""

import sys

from collective.cli import main

if __name__ == "__main__":
    sys.exit(main())
