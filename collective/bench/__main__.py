"""``python -m collective.bench``: the same as ``collective bench``."""

import argparse
import sys

from collective.bench import add_bench_parser, run_bench
from collective.entry import run_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collective.bench", allow_abbrev=False)
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return run_main(lambda: run_bench(args))


if __name__ == "__main__":
    sys.exit(main())
