"""A hostile holder process for tests/integration/test_hostile_fetch.py, built from the project's
own publish, plan and chunk code: it publishes ``big_state`` (tests/snapshot_holder.py) and
then bends what it serves. Its address goes to ``--address-file`` once it serves;
``state_digests.json`` beside it holds the honest tensors' digests and manifest.

``--attack``:
``none``      an honest holder
``flood``     its plan's pieces each claim 8 MiB, and keep coming (``--flood-mib`` in all);
              each piece sent is printed (``plan piece N``)
``claim``     its plan claims ``--claim-mib`` MiB (a consistent plan, fake chunk digests), and
              its data stream never sends a byte
``follow``    a provisional plan (``digests_follow``, no digests) over bytes forged after
              publishing: the only digests are the trailers it computes of what it sends
``forged``    the honest manifest (variable digests) over forged bytes whose chunk digests it
              lists: a plan that contradicts itself
``fine``      1-byte chunks (publish's own refusal bypassed)
``trickle``   its raw data path sends one byte a second
``slow``      its raw data path sends each chunk ``--slow-seconds`` after the one before (just
              inside the fetcher's stall timeout): never stalled, far below an honest holder
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import collective
from collective.digest import bytes_digest
from collective.plan import align, manifest_digest
from collective.snapshot import holder
from tests.snapshot_holder import big_state, digests, serve

PIECE = 4 << 20


def forge(state: dict) -> None:
    """Change the first tensor after its digests were taken (it is served in place)."""
    first = next(iter(state.values()))
    first.reshape(-1).view(np.uint8)[::4096] ^= 0xFF


def attack_plan(kind: str, plan, arena, state: dict, claim: int) -> None:
    """Bend ``plan`` (and the state's bytes) before the publication's Chunker is made of it."""
    size = plan.chunk_bytes
    if kind == "follow":
        forge(state)
        plan.digests_follow = True
        plan.manifest_digest = ""
        del plan.chunk_digests[:]
        for v in plan.variables:
            if v.nbytes:
                v.digest = ""
    elif kind == "forged":
        forge(state)
        del plan.chunk_digests[:]
        plan.chunk_digests.extend(bytes_digest(arena.slice(i, min(i + size, plan.total_bytes)))
                                  for i in range(0, plan.total_bytes, size))
    elif kind == "claim":
        first, last = plan.variables[0], plan.variables[-1]
        first.shape[:] = [claim // np.dtype(first.dtype).itemsize]
        first.nbytes = claim
        last.offset = align(claim)
        plan.total_bytes = last.offset + last.nbytes
        del plan.chunk_digests[:]
        plan.chunk_digests.extend(["0" * 32] * -(-plan.total_bytes // size))
        plan.manifest_digest = manifest_digest(plan.variables)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--attack", choices=("none", "flood", "claim", "follow", "forged", "fine", "trickle", "slow"),
                   default="none")
    p.add_argument("--mib", type=int, default=2)
    p.add_argument("--kib", type=int, default=0, help="a state of this many KiB instead of --mib MiB")
    p.add_argument("--step", type=int, default=8)
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--flood-mib", type=int, default=512)
    p.add_argument("--claim-mib", type=int, default=2048)
    p.add_argument("--address-file", required=True)
    p.add_argument("--name", default=None)
    p.add_argument("--slow-seconds", type=float, default=3.0)
    a = p.parse_args()
    if a.kib:
        state = {"x": np.random.default_rng(3).random(a.kib * 256, dtype=np.float32)}
    else:
        state = big_state(a.mib)
    honest = digests(state)
    chunk_bytes = a.chunk_bytes
    if a.attack == "fine":
        holder.snapshot_chunking_refused = lambda total, chunk: None
        chunk_bytes = 1
    seen: dict = {}
    if a.attack in ("follow", "forged", "claim"):
        real = holder.build

        def build(*args, **kwargs):
            plan, arena, keep = real(*args, **kwargs)
            seen["manifest"] = plan.manifest_digest  # the honest state's
            attack_plan(a.attack, plan, arena, state, a.claim_mib << 20)
            return plan, arena, keep

        holder.build = build
    if a.attack == "claim":
        from collective.stream import Chunker

        def silent(self, *args, **kwargs):  # the stream is asked for and never sends a byte
            time.sleep(600)
            yield from ()

        Chunker.frames = silent
    if a.attack == "flood":
        from collective._proto import collective_pb2 as pb
        from collective.transport.grpc import servicer

        blob = bytes(PIECE)

        def flood(data, piece_bytes=PIECE):
            for i in range(a.flood_mib * (1 << 20) // PIECE):
                yield pb.Piece(data=blob, total_bytes=8 << 20)
                print(f"plan piece {i + 1}", flush=True)

        servicer.to_pieces = flood
    if a.attack == "trickle":
        from collective.transport import rawtcp

        def trickle(sock, parts):
            for part in parts:
                for byte in bytes(memoryview(part).cast("B")):
                    sock.sendall(bytes([byte]))
                    time.sleep(1.0)

        rawtcp._send_all = trickle
    if a.attack == "slow":
        from collective.transport import rawtcp

        real_send = rawtcp._send_all

        def slow(sock, parts):
            if len(parts) == 3 and len(parts[2]):  # a chunk's frame (head, metadata, bytes)
                time.sleep(a.slow_seconds)
            real_send(sock, parts)

        rawtcp._send_all = slow
    pub = collective.publish(state, step=a.step, bind="127.0.0.1:0", chunk_bytes=chunk_bytes, name=a.name)
    folder = os.path.dirname(a.address_file)
    with open(os.path.join(folder, "state_digests.json"), "w") as fh:
        json.dump({"digests": honest, "manifest": seen.get("manifest", pub.manifest_digest)}, fh)
    serve(pub, a.address_file, a.step)


if __name__ == "__main__":
    main()
