"""``python -m tests.docs.update [PAGE ...]``: run the pages' examples as the doc tests do and,
where a ``console`` command prints something else than the page shows, write what it printed
into the page (the test directory's path becomes ``...``). For a change of output the code meant:
review the diff (keep the ``...`` lines that stood for varying lines) and commit it.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from tests.docs.blocks import ROOT, blocks, output_matches, pages
from tests.docs.test_doc_examples import _CARRY, Session, run_block


def update(page: Path) -> int:
    """Rewrite the shown output of ``page``'s console commands that no longer match; how many."""
    fixed = 0
    with tempfile.TemporaryDirectory() as tmp:
        session = Session(Path(tmp))
        try:
            for block in blocks(page):
                if block.file and block.not_run is None:
                    (session.dir / block.file).write_text(block.text)
                elif block.runs and block.lang != "console":
                    run_block(session, block)
                elif block.runs:
                    for cmd, shown in block.commands():
                        _, output = session.run(["bash", "-c", _CARRY + cmd], block.where)
                        if any(ln.strip() for ln in shown) and not output_matches(shown, output):
                            printed = output.replace(str(session.dir.resolve()) + "/", ".../").replace(tmp + "/", ".../")
                            printed = re.sub(r"(collective-run-)\w+", r"\1...", printed)  # launch's temporary dirs
                            fixed += _replace(page, cmd, shown, printed.rstrip("\n").splitlines())
        finally:
            session.close()
    return fixed


def _replace(page: Path, cmd: str, shown: list[str], printed: list[str]) -> int:
    text = page.read_text()
    for indent in ("", "  ", "    "):
        def at(lines: list[str], indent: str = indent) -> str:
            return "\n".join(indent + ln if ln else ln for ln in lines) + "\n"
        old = at([f"$ {cmd}", *shown]).rstrip("\n") + "\n"
        if old in text:
            page.write_text(text.replace(old, at([f"$ {cmd}", *printed]), 1))
            print(f"{page.relative_to(ROOT)}: `{cmd[:80]}` updated")
            return 1
    print(f"{page.relative_to(ROOT)}: `{cmd[:80]}` differs, but its block was not found to rewrite", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    chosen = [ROOT / a for a in argv] or pages()
    fixed = sum(update(p) for p in chosen)
    print(f"{fixed} command(s) updated")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
