"""mkdocs hook: a page line ``<!-- include: FILE.md -->`` becomes that top-level file's text.

ARCHITECTURE.md, SECURITY.md and BENCHMARKS.md stay where readers of the checkout and the
code's comments look for them; their pages in the site include them, so there is one copy.
The file's own title is dropped (the page has its own) and its links are made relative to
docs/: ``docs/x`` becomes ``x``, and a link to another included file goes to its page.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = {"ARCHITECTURE.md": "architecture.md", "SECURITY.md": "security.md", "BENCHMARKS.md": "benchmarks.md",
         "README.md": "index.md"}
_INCLUDE = re.compile(r"^<!-- include: ([\w.-]+\.md) -->$", re.M)


def _included(match: re.Match) -> str:
    name = match.group(1)
    text = (ROOT / name).read_text()
    lines = text.splitlines()
    if lines and lines[0].startswith("# "):
        text = "\n".join(lines[1:])
    text = text.replace("](docs/", "](")
    for top, page in PAGES.items():
        text = text.replace(f"]({top}", f"]({page}")
    return text


def on_page_markdown(markdown: str, page, config, files) -> str:
    return _INCLUDE.sub(_included, markdown)
