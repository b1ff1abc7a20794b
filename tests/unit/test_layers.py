"""The package's imports run one way: no circle, and no module imports a layer above its own.

The graph is grimp's (the engine of import-linter): every ``import`` statement of the project's
modules, also those inside functions, which hide a dependency but do not remove it. LAYERS is
the house plan, lowest first. A module may import its own layer and the ones below, never one
above. ARCHITECTURE.md's layer table is LAYERS itself, each layer with the comment above it,
written by ``python -m tools.docgen`` (tests/docs/test_architecture_doc.py fails when stale).
"""

from __future__ import annotations

import ast
import sys

import grimp
import pytest

from tests.procs import ROOT

PACKAGES = ("collective",)

# Lowest first. A name covers the module and everything under it.
LAYERS: list[tuple[str, ...]] = [
    # What every layer may use: errors, units, digests, logging, the wire types.
    ("collective.errors", "collective.dtypes", "collective.tensors", "collective.digest", "collective.sizes", "collective.logs",
     "collective.entry", "collective.keys", "collective.limits", "collective.outfile", "collective._proto",
     "collective.parking",
     "collective._protogen"),
    # Settings: timeouts, TLS files, COLLECTIVE_* and the clusters' own variables.
    ("collective.config", "collective.clusterenv"),
    # Models: variables and where their initial values come from.
    ("collective.model", "collective.variables", "collective.sources"),
    # The plan (the arena's layout, chunks, receivers), who feeds whom, replicas of it, and a
    # tensor's element-level deltas against that layout.
    ("collective.plan", "collective.arena", "collective.stream", "collective.shards", "collective.topology", "collective.replicas",
     "collective.delta"),
    # Transports: the interface and its backends.
    ("collective.transport",),
    # The command-line flags of the two roles, and their start.
    ("collective.options",),
    # The two roles, written once against the transport interface.
    ("collective.chief", "collective.worker"),
    # Round runners: the MPI round, and the summary table it and launch print.
    ("collective.mpi", "collective.summary"),
    # The public Python API.
    ("collective._api", "collective.checks", "collective.snapshot", "collective"),
    # Framework hand-offs, on top of the API (collective.vllm: vLLM's weight-transfer engine).
    ("collective.torch", "collective.torchft", "collective.jax", "collective.tf", "collective.vllm"),
    # Command lines: the collective command's folder (one module per command, with what only
    # they show or keep: launch's run directory, the status table, the merged logs), the roles'
    # entry points, and the benchmark behind `collective bench`.
    ("collective.cli", "collective.chief.__main__", "collective.worker.__main__", "collective.bench"),
]


def _layer_of(module: str) -> int:
    best, index = "", None
    for i, layer in enumerate(LAYERS):
        for name in layer:
            if (module == name or module.startswith(name + ".")) and len(name) > len(best):
                best, index = name, i
    if index is None:
        raise AssertionError(f"{module} is in no layer of tests/unit/test_layers.py: add it where it belongs")
    return index


@pytest.fixture(scope="module")
def graph():
    sys.path.insert(0, str(ROOT))  # the checkout's package, whatever is installed
    try:
        return grimp.build_graph(*PACKAGES, cache_dir=None)
    finally:
        sys.path.remove(str(ROOT))


def _imports(graph) -> list[tuple[str, str]]:
    return sorted((m, t) for m in graph.modules for t in graph.find_modules_directly_imported_by(m))


def _circles(edges: list[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    succ: dict[str, list[str]] = {}
    for a, b in edges:
        succ.setdefault(a, []).append(b)
        succ.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return out


def test_the_circle_finder_finds_a_circle_and_passes_a_line():
    assert _circles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [["a", "b", "c"]]
    assert _circles([("a", "b"), ("b", "c")]) == []


def test_no_import_circle_in_the_package(graph):
    # Imports of a package's own __init__ by its modules (``from collective import logs``) are
    # grimp's edges to the submodule, not to the package.
    circles = _circles(_imports(graph))
    assert circles == [], "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_no_module_imports_a_layer_above_its_own(graph):
    upward = [
        f"{a} (layer {_layer_of(a)}) imports {b} (layer {_layer_of(b)})"
        for a, b in _imports(graph)
        if _layer_of(b) > _layer_of(a)
    ]
    assert upward == [], "upward imports:\n" + "\n".join(upward)


def test_every_module_has_a_layer(graph):
    for module in graph.modules:
        _layer_of(module)  # raises naming the module


def _reaches_outside(source: str) -> list[tuple[int, str]]:
    """(line, what) for each import of the checkout's ``tools`` and each edit of ``sys.path``
    (an assignment to it, or a call of one of its methods) in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] == "tools"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "tools":
            out.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Name) and \
                node.func.id == "__import__" and isinstance(node.args[0], ast.Constant) and \
                str(node.args[0].value).split(".")[0] == "tools":
            out.append((node.lineno, f"__import__({node.args[0].value!r})"))
        targets = [node.func.value] if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else \
            node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            while isinstance(t, ast.Subscript):
                t = t.value
            if ast.unparse(t) == "sys.path":
                out.append((node.lineno, f"sys.path edited: {ast.unparse(node)[:60]}"))
    return sorted(out)


def test_the_reach_finder_finds_tools_and_sys_path_edits():
    found = _reaches_outside(
        "import tools.bench\nfrom tools import docgen\nimport sys\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']\n"
        "sys.path += ['z']\n__import__('tools')\nimport toolsmith\nfrom .tools import x\nprint(sys.path[0])\n")
    assert [line for line, _ in found] == [1, 2, 4, 5, 6, 7]


def test_the_package_never_imports_the_checkouts_tools_nor_edits_sys_path():
    # An installed wheel has collective/ alone: whatever it needs must be inside it, found by an
    # import, never by putting the checkout on sys.path (tools/ may import the package, not back).
    found = [f"{path.relative_to(ROOT)}:{line}: {what}"
             for path in sorted((ROOT / "collective").rglob("*.py")) if "_proto" not in path.parts
             for line, what in _reaches_outside(path.read_text())]
    assert found == [], "the package reaches outside itself:\n" + "\n".join(found)
