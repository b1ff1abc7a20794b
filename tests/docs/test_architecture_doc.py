"""ARCHITECTURE.md is drawn from the code: its layer table is the layer test's own (written by
tools/docgen.py), its module map names every module of the package and only files that exist,
and every file and option it names in backquotes is one the checkout has."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.docs.blocks import pages
from tests.procs import ROOT
from tests.unit.test_layers import LAYERS
from tools import docgen

PAGE = ROOT / "ARCHITECTURE.md"


def test_the_layer_table_is_the_layer_tests_own():
    assert [modules for _, modules in docgen.layers()] == [tuple(layer) for layer in LAYERS]
    text = PAGE.read_text()
    assert text == docgen.architecture(text), (
        "ARCHITECTURE.md's layer table differs from LAYERS in tests/unit/test_layers.py: run "
        "`python -m tools.docgen` and commit it")
    section = text[text.index(docgen.LAYERS_BEGIN):text.index(docgen.LAYERS_END)]
    rows = [line.split(" | ")[1] for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [re.findall(r"`([\w.]+)`", row) for row in rows] == [
        [m.removeprefix("collective.") if m != "collective" else m for m in layer] for layer in LAYERS]


def test_the_table_follows_a_change_of_the_layer_test(tmp_path, monkeypatch):
    changed = tmp_path / "test_layers.py"
    changed.write_text('import grimp\n\n# Lowest first.\nLAYERS: list[tuple[str, ...]] = [\n'
                       '    # Low: the first.\n    ("collective.a", "collective.b"),\n'
                       '    # High: the second,\n    # in two lines.\n    ("collective",\n     "collective.c.d"),\n]\n')
    assert docgen.layers(changed) == [("Low: the first.", ("collective.a", "collective.b")),
                                      ("High: the second, in two lines.", ("collective", "collective.c.d"))]
    table = docgen.layer_table(changed)
    assert "| 0 | `a`, `b` | Low: the first. |\n| 1 | `collective`, `c.d` | High: the second, in two lines. |" in table
    monkeypatch.setattr(docgen, "LAYER_TEST", changed)
    assert docgen.main(["--check"]) == 1  # the committed page is stale against that test


def _module_map() -> dict[Path, str]:
    """The code block under "## Layers": each path it names (resolved against the folder it is
    indented under, else the checkout) -> its entry's text (the description lines with it)."""
    text = PAGE.read_text()
    block = text[text.index("## Layers"):]
    block = block[block.index("```text\n") + 8:]
    block = block[:block.index("\n```")]
    entries: dict[Path, str] = {}
    folders: list[tuple[int, Path]] = []  # (indent, folder) of the enclosing entries
    current: list[Path] = []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if indent >= 20:  # a description's next line
            for path in current:
                entries[path] += " " + line.strip()
            continue
        name_column, _, description = line.strip().partition("  ")
        while folders and folders[-1][0] >= indent:
            folders.pop()
        base = folders[-1][1] if folders else ROOT
        current = [base / name.strip() for name in name_column.split(",")]
        for path, name in zip(current, name_column.split(","), strict=True):
            entries[path] = description.strip()
            if name.strip().endswith("/"):
                folders.append((indent, path))
    return entries


def test_the_module_map_names_every_module_and_only_files_that_exist():
    """Every module of the package and of the checkout's tools/ is in the map (an entry of its
    own, or named in its folder's entry)."""
    entries = _module_map()
    assert ROOT / "collective" / "chief" / "service.py" in entries  # the reader finds what it must
    absent = sorted(str(p.relative_to(ROOT)) for p in entries if not p.exists())
    assert not absent, f"the map of ARCHITECTURE.md names what the checkout does not have: {absent}"
    missing = []
    for module in sorted([*ROOT.glob("collective/**/*.py"), *ROOT.glob("tools/**/*.py")]):
        if module in entries or module.parent.name == "_proto":
            continue
        folder = module.parent
        if module.name in ("__init__.py", "__main__.py") and module != ROOT / "collective" / "__init__.py":
            continue  # a package's: its folder or its modules stand for it
        if folder in entries and module.name in entries[folder]:  # a folder's entry names its files
            continue
        missing.append(str(module.relative_to(ROOT)))
    assert not missing, f"modules the map of ARCHITECTURE.md leaves out: {missing}"


def _options() -> set[str]:
    from collective.config import reading

    flags = set()
    with reading({}):
        for _, _, parser in docgen.commands():
            for action in parser._actions:
                flags.update(action.option_strings)
    return flags


# Options of other programs the page names on purpose (torchrun's restarts), files a run writes.
FOREIGN_OPTIONS = {"--max-restarts"}
RUN_FILES = {"result.json"}


def test_every_option_and_file_the_page_names_is_the_codes():
    text = PAGE.read_text()
    named = set(re.findall(r"`(--[a-z][a-z0-9-]*)", text))
    assert "--rejoin-timeout" in named
    unknown = sorted(named - _options() - FOREIGN_OPTIONS)
    assert not unknown, f"options ARCHITECTURE.md names that no command has: {unknown}"
    files = set(re.findall(r"`([\w/.-]+\.(?:py|proto|md|json|yml|sh))`", text))
    assert "chief/rejoin.py" in files
    names = {p.name for p in ROOT.glob("collective/**/*.py")}  # a bare name, in a section on its folder
    gone = sorted(f for f in files - RUN_FILES
                  if not any((base / f).exists() for base in (ROOT, ROOT / "collective")) and f not in names)
    assert not gone, f"files ARCHITECTURE.md names that the checkout does not have: {gone}"


def _reference_modules() -> set[str]:
    return set(re.findall(r"^::: (collective[\w.]*)$", (ROOT / "docs/reference/api.md").read_text(), re.M))


def test_every_public_module_is_in_the_api_reference():
    """Public: the package, and every module the docs or the examples tell a user to
    ``import collective.X`` (the framework hand-offs, torchft's transport)."""
    texts = [p.read_text() for p in (*pages(), *ROOT.glob("examples/**/*.py"))]
    imported = {m for t in texts for m in re.findall(r"\bimport (collective\.\w+)", t)
                if _module(m.split(".")[1:])}  # a module, not a placeholder (`import collective.X`)
    assert {"collective.torch", "collective.torchft"} <= imported  # the scan finds what it must
    documented = _reference_modules()
    missing = sorted({"collective", *imported} - documented)
    assert not missing, f"public modules docs/reference/api.md leaves out: {missing}"
    for module in documented:
        path = ROOT / module.replace(".", "/")
        assert path.with_suffix(".py").exists() or (path / "__init__.py").exists(), module


def _module(parts: list[str]) -> Path | None:
    """The file of module ``parts`` (``["chief/arena"]``, ``["transport", "grpc"]``) in the
    package, or of the checkout's tools, if there is one."""
    for base in (ROOT / "collective", ROOT):
        path = base.joinpath(*parts)
        for file in (path.with_suffix(".py"), path / "__init__.py"):
            if file.is_file():
                return file
    return None


def _names(file: Path) -> tuple[set[str], dict[str, set[str]]]:
    """What ``file`` defines or imports (by any name), and each of its classes' members (methods,
    class attributes, ``self.x`` set in its methods)."""
    tree = ast.parse(file.read_text())
    names: set[str] = set()
    classes: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[-1])
        if isinstance(node, ast.ClassDef):
            members = classes.setdefault(node.name, set())
            for sub in ast.walk(node):
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    members.add(sub.name)
                elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    members.add(sub.id)
                elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                    members.add(sub.attr)
    return names, classes


# Dotted names of other libraries that a module of ours shadows in the page's words.
FOREIGN_NAMES = {"jax.Array"}


def _misplaced(text: str) -> list[str]:
    """The dotted names in backquotes in ``text`` that are not where they say: a module's own
    name or one it imports (``plan.frame_messages``, ``chief/arena.map_files``), a class's member
    (``ChiefService.sent``). Names whose first part is neither a module nor a class of ours are
    not judged."""
    refs = {r for quoted in re.findall(r"`([^`\n]+)`", text)
            for r in re.findall(r"\b[A-Za-z_][\w/]*(?:\.[A-Za-z_]\w*)+", quoted)}
    refs = {r.removeprefix("collective.") for r in refs - FOREIGN_NAMES
            if r.rsplit(".", 1)[1] not in ("py", "md", "json", "yml", "proto", "sh")}
    all_classes: dict[str, set[str]] = {}
    for file in [*ROOT.glob("collective/**/*.py"), *ROOT.glob("tools/**/*.py")]:
        for name, members in _names(file)[1].items():
            all_classes.setdefault(name, set()).update(members)
    wrong = []
    for ref in sorted(refs):
        parts = ref.split(".")
        k = next((k for k in range(len(parts), 0, -1) if _module(parts[:k])), 0)
        if k:
            if k == len(parts):
                continue
            names, classes = _names(_module(parts[:k]))
            if parts[k] not in names or (len(parts) > k + 1 and parts[k] in classes
                                         and parts[k + 1] not in classes[parts[k]]):
                wrong.append(ref)
        elif parts[0] in all_classes and parts[1] not in all_classes[parts[0]]:
            wrong.append(ref)
    return wrong


def test_the_name_checker_finds_a_misplaced_name():
    sample = ("`plan.frame_messages`, `chief/arena.map_files`, `ChiefService.sent`, `jax.Array`, `numpy.ndarray`; "
              "`arena.map_files`, `_api.hold_chief_replicas`, `ChiefService.no_such`, `collective.stream.Nope`")
    assert _misplaced(sample) == ["ChiefService.no_such", "_api.hold_chief_replicas", "arena.map_files", "stream.Nope"]


def test_every_module_member_the_page_names_is_in_that_module():
    wrong = _misplaced(PAGE.read_text())
    assert not wrong, f"names ARCHITECTURE.md gives that are not where it says: {wrong}"
