"""The package's imports run one way: no circle, and no module imports a layer above its own.

The graph is grimp's (the engine of import-linter): every ``import`` statement of the project's
modules, also those inside functions, which hide a dependency but do not remove it. LAYERS is
the house plan, lowest first. A module may import its own layer and the ones below, never one
above. ARCHITECTURE.md's layer table is LAYERS itself, each layer with the comment above it,
written by ``python -m tools.docgen`` (tests/docs/test_architecture_doc.py fails when stale).
"""

from __future__ import annotations

import sys

import grimp
import pytest

from tests.procs import ROOT

PACKAGES = ("collective",)

# Lowest first. A name covers the module and everything under it.
LAYERS: list[tuple[str, ...]] = [
    # What every layer may use: errors, units, digests, logging, the wire types.
    ("collective.errors", "collective.dtypes", "collective.tensors", "collective.digest", "collective.sizes", "collective.logs",
     "collective.entry", "collective.keys", "collective.limits", "collective.status", "collective.logmerge", "collective.rundir", "collective.outfile", "collective._proto",
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
    # Round runners: the local launcher and the MPI round, and the summary table they print.
    ("collective.launch", "collective.mpi", "collective.summary"),
    # The public Python API.
    ("collective._api", "collective.checks", "collective.snapshot", "collective"),
    # Framework hand-offs, on top of the API.
    ("collective.torch", "collective.torchft", "collective.jax", "collective.tf"),
    # Command lines and tools.
    ("collective.cli", "collective.doctor", "collective.chief.__main__",
     "collective.worker.__main__"),
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
