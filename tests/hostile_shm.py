"""Processes for tests/integration/test_hostile_shm.py: a hostile same-host holder and a fetcher
that keeps what it fetched, each driven through files in ``--folder`` (written atomically).

``hold --mode M``: ``collective.publish(copy=True)`` with ``SharedArena.seal`` replaced, so the
memory file a same-host fetcher is handed is not what an honest holder hands out:

``unsealed``      not sealed at all; the holder keeps its writable mapping
``future-write``  sealed with F_SEAL_FUTURE_WRITE | F_SEAL_SHRINK | F_SEAL_GROW while the
                  holder keeps its writable mapping (which that seal leaves writable)
``no-shrink``     sealed honestly but without F_SEAL_SHRINK (F_SEAL_WRITE | F_SEAL_GROW)

It writes ``address`` and ``published.json`` (every tensor's digest), then waits for ``act``:
``write`` (0xEE over every byte of the memory file, through its mapping) or ``truncate`` (the
file cut to 0 bytes), does it, and writes ``done``.

``fetch --address A``: ``collective.fetch`` of step 3, writes ``fetched.json`` (digests and
whether shared memory was used), waits for ``recheck``, hashes the same arrays again and writes
``after.json``. A mapping that changed shows in its digests; one cut short kills it (SIGBUS).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import time
from pathlib import Path

import numpy as np

import collective
from collective import arena as arenas_module
from collective.digest import array_digest
from collective.snapshot import tree
from collective.transport import shm
from tests.clusters import TOKEN

F_SEAL_FUTURE_WRITE = 0x0010  # linux/fcntl.h; not in Python's fcntl module
STEP = 3


def _put(folder: Path, name: str, text: str) -> None:
    tmp = folder / f"{name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, folder / name)


def _await(folder: Path, name: str, timeout: float = 300.0) -> str:
    deadline = time.monotonic() + timeout
    while not (folder / name).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{name} not written within {timeout:g} s")
        time.sleep(0.02)
    return (folder / name).read_text()


def _digests(state) -> dict:
    _, arrays = tree.flatten(state)
    return {name: array_digest(a) for name, a in arrays.items()}


def hold(folder: Path, mode: str) -> None:
    arenas: list[shm.SharedArena] = []
    honest = shm.SharedArena.seal

    def seal(self: shm.SharedArena) -> None:
        if mode == "future-write":
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        elif mode == "no-shrink":
            arenas_module._seals = lambda: fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW
            honest(self)
        arenas.append(self)  # "unsealed": nothing at all, the writable mapping kept

    shm.SharedArena.seal = seal
    rng = np.random.default_rng(5)
    state = {f"w{i}": rng.random(1 << 18, dtype=np.float32) for i in range(4)}  # 4 MiB
    pub = collective.publish(state, step=STEP, bind="127.0.0.1:0", copy=True, name="hostile")
    _put(folder, "published.json", json.dumps(_digests(state)))
    _put(folder, "address", pub.address)
    act = _await(folder, "act", timeout=600)
    arena = arenas[0]
    if act == "write":
        if arena.array.flags.writeable:
            arena.array[:] = 0xEE  # the memory file itself: what every mapping of it shows
        else:
            os.pwrite(arena.fd, b"\xee" * arena.size, 0)
    else:
        os.ftruncate(arena.fd, 0)
    _put(folder, "done", act)
    time.sleep(600)  # killed by the test


def fetch(folder: Path, address: str) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    got = collective.fetch(address, step=STEP, token=TOKEN, timeout=120)
    _put(folder, "fetched.json", json.dumps({"digests": _digests(got),
                                             "shared_memory": got.stats[address]["shared_memory"]}))
    _await(folder, "recheck")
    _put(folder, "after.json", json.dumps(_digests(got)))  # a mapping cut short: SIGBUS here


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("hold", "fetch"))
    p.add_argument("--folder", required=True, type=Path)
    p.add_argument("--mode", choices=("unsealed", "future-write", "no-shrink"), default="unsealed")
    p.add_argument("--address", default="")
    a = p.parse_args()
    if a.role == "hold":
        hold(a.folder, a.mode)
    else:
        fetch(a.folder, a.address)


if __name__ == "__main__":
    main()
