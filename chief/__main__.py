"""``python -m chief`` from a checkout: the same as ``python -m collective.chief``."""

import sys

from collective.chief.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
