"""One arena module (issue 37, step 1): the ``Arena`` a ``Chunker`` reads, the one scatter view of
shards and holders, the memfd arena's pages, and the structure itself (no second home)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import numpy as np
import pytest

from collective.arena import Arena, Flat, ScatterView, SharedArena, as_arena

PACKAGE = Path(__file__).resolve().parents[2] / "collective"


def test_a_scatter_view_reads_its_pieces_in_place_and_gathers_across_them():
    # A holder's state (pieces of their own) and a shard (pieces of one array, with origins)
    # are the same view: a range inside one piece is a view of it, one across pieces or
    # padding is gathered, the padding read as zeros.
    a, b = np.arange(10, dtype=np.uint8), np.arange(100, 106, dtype=np.uint8)
    holder = ScatterView([(0, a), (16, b), (30, np.empty(0, np.uint8))], 24)
    assert np.shares_memory(np.frombuffer(holder.slice(2, 8), np.uint8), a)
    assert bytes(holder.slice(8, 18)) == bytes([8, 9] + [0] * 6 + [100, 101])
    assert bytes(holder.slice(0, 24)) == a.tobytes() + bytes(6) + b.tobytes() + bytes(2)
    model = np.arange(64, dtype=np.uint8)
    shard = ScatterView.within(model, [(0, 40, 8), (8, 4, 0), (16, 10, 4)], 20)
    assert shard.segments == [(0, 40, 8), (16, 10, 4)]
    assert np.shares_memory(np.frombuffer(shard.slice(1, 7), np.uint8), model)
    assert bytes(shard.slice(6, 18)) == bytes([46, 47] + [0] * 8 + [10, 11])
    assert shard.sources(6, 18) == [(46, 48), (10, 12)]
    assert bytes(shard.copy()) == bytes(shard.slice(0, 20))


def test_every_arena_a_chunker_reads_is_one_protocol():
    # A flat array, a scatter view, a shared arena's array: read through ``slice`` alone.
    arrays = [np.arange(8, dtype=np.uint8), ScatterView([(0, np.arange(8, dtype=np.uint8))], 8)]
    for arena in arrays:
        view: Arena = as_arena(arena)
        assert (view.nbytes, bytes(view.slice(2, 5))) == (8, bytes([2, 3, 4]))
    assert isinstance(as_arena(arrays[0]), Flat) and as_arena(arrays[1]) is arrays[1]


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd (Linux)")
@pytest.mark.parametrize("slow", [False, True], ids=["written", "populated"])
def test_a_shared_arena_s_pages_are_in_place_when_asked(monkeypatch, slow):
    # The memfd arena takes the receive arenas' routine (arena.populate): a write per page, or
    # after a slow first segment the kernel populating the rest.
    from collective import arena as arenas
    from tests.unit.test_plan import _mappings

    monkeypatch.setattr(arenas, "SEGMENT", 4 << 20)
    monkeypatch.setattr(arenas, "SEGMENT_SLOW", -1.0 if slow else 1e9)  # never by chance on a loaded machine
    shared = SharedArena(12 << 20, prefault=True)
    try:
        maps, at, resident = _mappings(), shared.array.ctypes.data, 0
        while at < shared.array.ctypes.data + (12 << 20):  # the hint after a slow segment splits it
            resident, at = resident + maps[at]["Rss"], at + maps[at]["size"]
        assert resident == 12 << 20, maps[shared.array.ctypes.data]
    finally:
        shared.close()


def _calls(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return names


def test_arenas_live_in_one_module():
    # The structure, checked so it cannot drift back: pages are put in place (madvise populate,
    # MAP_POPULATE, huge-page hints) and memfd arenas made only in collective/arena.py; no
    # module but it defines an arena's ``slice``; no ``hasattr`` tells arenas apart. The
    # benchmark's prefault.py times each way against the others, so it names them all.
    home, bench = PACKAGE / "arena.py", PACKAGE / "bench" / "prefault.py"
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in (home, bench) or "_proto" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        used = _calls(tree) & {"MAP_POPULATE", "MADV_HUGEPAGE", "MADV_POPULATE_WRITE", "memfd_create"}
        used |= {f"def {n.name}" for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "slice"}
        used |= {"hasattr(arena)" for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Name) and n.func.id == "hasattr"
                 and n.args and isinstance(n.args[0], ast.Name) and "arena" in n.args[0].id}
        found += [f"{path.relative_to(PACKAGE.parent)}: {u}" for u in sorted(used)]
    assert not found, found
