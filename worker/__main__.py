"""``python -m worker`` from a checkout: the same as ``python -m collective.worker``."""

import sys

from collective.worker.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
