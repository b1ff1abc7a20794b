"""The fenced code blocks of README.md and docs/, and how each is checked.

Every fence must name its language; what the language says decides the check:

* ``console``: ``$ command`` lines, each followed by the output the page shows. Each command is
  run with bash; the output shown must match what it prints (stdout and stderr together) after
  both are normalized: numbers become ``N`` and hex ids ``H`` (times, ports, pids, digests
  vary), runs of spaces one space. A line ``...`` stands for any lines, ``...`` inside a line
  for any text.
* ``bash`` / ``sh``: a script, run with ``bash -e``; ``bash -n`` first.
* ``python``: a script, run with the suite's Python; ``compile()`` first.
* ``yaml`` / ``json``: parsed (``yaml.safe_load`` / ``json.loads``).
* ``text``, ``ini``, ``toml``: shown output or a sample; not run.

An HTML comment on the line before a fence changes that: ``<!-- not-run: reason -->`` keeps the
block to its syntax check (it needs docker, kubectl, several hosts, a GPU, minutes...), and
``<!-- exit: N -->`` says every command of the block must exit N (default 0), and
``<!-- file: NAME -->`` writes the block to the file NAME of the session instead of running it
(a script the next block runs).

The runnable blocks of one page run in order, in one temporary directory (a session: a file one
block writes, the next may read), which holds links to the checkout's ``examples/`` and
``deploy/``; background processes a block starts are killed by process group at the page's end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

RUN = {"console", "bash", "sh", "python"}
PARSE = {"yaml", "json"}
SHOWN = {"text", "ini", "toml"}
LANGUAGES = RUN | PARSE | SHOWN

_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)[^\n]*$")
_MARK = re.compile(r"^\s*<!--\s*(not-run|exit|file)\s*:\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    page: str          # path relative to the checkout
    line: int          # 1-based line of the opening fence
    lang: str
    text: str
    not_run: str | None = None   # the reason, when the block is only syntax-checked
    exit: int = 0
    file: str | None = None      # written to this file in the session, not run

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in RUN and self.not_run is None and self.file is None

    def commands(self) -> list[tuple[str, list[str]]]:
        """A console block's (command, output lines shown); ``\\`` continues a command."""
        out: list[tuple[str, list[str]]] = []
        lines = self.text.splitlines()
        i = 0
        while i < len(lines):
            ln = lines[i]
            if ln.startswith("$ "):
                cmd = ln[2:]
                while cmd.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    cmd = cmd[:-1] + " " + lines[i].strip()
                out.append((cmd, []))
            elif out:
                out[-1][1].append(ln)
            i += 1
        return out


# The top-level files the site's pages include (tools/mkdocs_hooks.py): their blocks count too.
INCLUDED = ("ARCHITECTURE.md", "SECURITY.md", "BENCHMARKS.md")


def pages() -> list[Path]:
    """README.md, the files the site includes, and every page of the site (the generated
    options reference included)."""
    return [ROOT / "README.md", *(ROOT / n for n in INCLUDED), *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    rel = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1
        block = Block(rel, start + 1, lang, "\n".join(body) + "\n")
        j = start - 1
        while j >= 0 and (mark := _MARK.match(lines[j])):
            if mark.group(1) == "not-run":
                block.not_run = mark.group(2)
            elif mark.group(1) == "file":
                block.file = mark.group(2)
            else:
                block.exit = int(mark.group(2))
            j -= 1
        out.append(block)
    return out


def _normal(line: str) -> str:
    line = re.sub(r"[0-9a-f]{8,}", "H", line)
    line = re.sub(r"\d+(?:[.,]\d+)*", "N", line)
    return " ".join(line.split())


def output_matches(shown: list[str], actual: str) -> bool:
    """Does ``actual`` match the lines a page shows (see the module's docstring)?"""
    while shown and not shown[-1].strip():
        shown = shown[:-1]
    parts: list[str] = []
    for ln in shown:
        if ln.strip() in ("...", "…"):
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            norm = re.escape(_normal(ln)).replace(r"\.\.\.", ".*").replace("…", ".*")
            parts.append(norm + r"\n")
    got = "".join(_normal(ln) + "\n" for ln in actual.splitlines() if ln.strip())
    want = "".join(p for p, ln in zip(parts, shown, strict=True) if ln.strip())
    return re.fullmatch(want, got) is not None
