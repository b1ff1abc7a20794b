"""The README's and the docs' examples run (tests/docs/blocks.py says how each block is checked).

Each page's runnable blocks run in order in one session directory; every command has a
deadline, and whatever a page started is killed by its process group when the page is done.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.docs.blocks import LANGUAGES, PARSE, ROOT, Block, blocks, output_matches, pages

PAGES = pages()
ALL = [b for p in PAGES for b in blocks(p)]
# A generous bound for one command on a loaded 2-core machine: the slowest runs a short launch.
COMMAND_TIMEOUT = 120.0


def test_every_fence_names_a_known_language():
    bad = [f"{b.where} ({b.lang or 'no language'})" for b in ALL if b.lang not in LANGUAGES]
    assert not bad, f"fences without a checked language (one of {sorted(LANGUAGES)}): {bad}"


def test_every_block_not_run_says_why():
    assert [b.where for b in ALL if b.not_run is not None and not b.not_run] == []


@pytest.mark.parametrize("block", [b for b in ALL if b.lang not in ("text", "ini", "toml")], ids=lambda b: b.where)
def test_block_syntax(block: Block):
    """Every block is at least parsed, the ones not run here included."""
    if block.lang == "python":
        compile(block.text, block.where, "exec")
    elif block.lang in ("bash", "sh"):
        r = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, f"{block.where}: {r.stderr}"
    elif block.lang == "console":
        assert block.commands(), f"{block.where}: a console block without a `$ ` command"
        for cmd, _ in block.commands():
            r = subprocess.run(["bash", "-n"], input=cmd, capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, f"{block.where}: {cmd}: {r.stderr}"
    elif block.lang == "yaml":
        list(yaml.safe_load_all(block.text))
    elif block.lang == "json":
        json.loads(block.text)
    else:
        assert block.lang not in PARSE


def _env(session: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    env["TMPDIR"] = str(session)  # launch's default run directories land here, not in /tmp
    return env


class Session:
    """One page's working directory and the process groups its blocks started."""

    def __init__(self, path: Path) -> None:
        self.dir = path
        self.env = _env(path)
        self.groups: list[int] = []
        self.count = 0
        for name in ("examples", "deploy"):
            (path / name).symlink_to(ROOT / name)

    def run(self, args: list[str], where: str) -> tuple[int, str]:
        """Run ``args`` with a deadline; stdout and stderr together. A file, not a pipe, takes
        the output: a background job the command leaves would hold a pipe open."""
        self.count += 1
        out = self.dir / f".out-{self.count}"
        with open(out, "w") as fh:
            proc = subprocess.Popen(args, cwd=self.dir, env=self.env, stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.groups.append(proc.pid)
        try:
            code = proc.wait(COMMAND_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill(proc.pid)
            proc.wait(10)
            raise AssertionError(f"{where}: {args[-1][:200]!r} did not end within {COMMAND_TIMEOUT:g} s:\n"
                                 f"{out.read_text()[-3000:]}") from None
        return code, out.read_text()

    @staticmethod
    def kill(group: int) -> None:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        for group in self.groups:
            self.kill(group)


# What a block exports reaches the page's next blocks, as in one terminal: each command starts by
# reading the variables the one before it left, and leaves its own when it ends.
_ENV_FILE = ".session-env"
_CARRY = f"trap 'export -p > {_ENV_FILE}' EXIT; if [ -f {_ENV_FILE} ]; then source {_ENV_FILE}; fi\n"


def run_block(session: Session, block: Block) -> None:
    if block.lang == "console":
        for cmd, shown in block.commands():
            code, output = session.run(["bash", "-c", _CARRY + cmd], block.where)
            assert code == block.exit, f"{block.where}: `{cmd}` exited {code}, not {block.exit}:\n{output[-3000:]}"
            if any(ln.strip() for ln in shown):
                assert output_matches(shown, output), (
                    f"{block.where}: `{cmd}` printed what the page does not show.\n--- page:\n"
                    + "\n".join(shown) + f"\n--- printed:\n{output}")
    elif block.lang in ("bash", "sh"):
        code, output = session.run(["bash", "-e", "-c", _CARRY + block.text], block.where)
        assert code == block.exit, f"{block.where}: the script exited {code}, not {block.exit}:\n{output[-3000:]}"
    else:
        script = session.dir / f"block_{block.line}.py"
        script.write_text(block.text)
        code, output = session.run([sys.executable, script.name], block.where)
        assert code == block.exit, f"{block.where}: the Python block exited {code}, not {block.exit}:\n{output[-3000:]}"


RUNNABLE = [p for p in PAGES if any(b.runs for b in blocks(p))]


def _missing(page: Path) -> str | None:
    """What the page's runnable blocks need that this environment lacks, with how to install it."""
    text = "".join(b.text for b in blocks(page) if b.runs)
    bindir = os.path.dirname(sys.executable)
    if "mpiexec" in text and not shutil.which("mpiexec", path=bindir + os.pathsep + os.environ.get("PATH", "")):
        return "mpiexec, which is not installed (pip install -e '.[mpi]')"
    if "examples/rl_loop" in text and importlib.util.find_spec("transformers") is None:
        return "examples/rl_loop, whose transformers is not installed (pip install -e '.[rl]')"
    return None


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page: Path, tmp_path: Path):
    missing = _missing(page)
    if missing:
        # make test installs MPI (the mpi extra) and transformers (the rl extra) and requires
        # them; a bare pytest may not have them.
        if os.environ.get("COLLECTIVE_REQUIRE_FRAMEWORKS") == "1":
            pytest.fail(f"{page.name} runs {missing}")
        pytest.skip(f"{page.name} runs {missing}")
    session = Session(tmp_path)
    try:
        for block in blocks(page):
            if block.file and block.not_run is None:
                (session.dir / block.file).write_text(block.text)
            elif block.runs:
                run_block(session, block)
    finally:
        session.close()


def test_readme_is_short_and_opens_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200, "README.md is over 200 lines: move the detail into a page of docs/"
    first = next(b for b in blocks(ROOT / "README.md"))
    assert [ln.split()[:2] for ln in first.text.splitlines()] == [["make", "demo"], ["make", "test"]]
