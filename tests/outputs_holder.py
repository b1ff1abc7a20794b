"""A holder process for tests/integration/test_fetch_out.py: publishes a small state (one tensor
``w``, or as named) and serves it until killed. Its address goes to ``--address-file`` once it
serves.

``--tensor NAME``     the tensor's name (a key path: ``../../../../home/x`` is one tensor)
``--long-name N``     the tensor named by N characters
``--mib N``           the tensor's size (default 1 MiB)

Hostile (what a holder built from the project's own code can send):
``--error-chars N``   every data stream it serves fails with an error whose message is N characters
                      (its culprit and phase ``--error-field-chars`` each), sent whole: the cut an
                      honest sender makes (``logs.printable`` in the raw data path and in the gRPC
                      servicer, of the culprit in gRPC's trailers) is removed
``--tree-step-chars N``  its structure (the TREE variable, covered by its own plan's digests)
                      names as its step a string of N characters, with a terminal escape
``--tree-kind-chars N``  its structure holds a node whose kind is N characters
"""

from __future__ import annotations

import argparse

import numpy as np

import collective
from collective import errors as E
from collective.stream import Chunker
from tests.snapshot_holder import serve


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--address-file", required=True)
    p.add_argument("--step", type=int, default=8)
    p.add_argument("--tensor", default="w")
    p.add_argument("--long-name", type=int, default=0)
    p.add_argument("--mib", type=float, default=1.0)
    p.add_argument("--error-chars", type=int, default=0)
    p.add_argument("--error-field-chars", type=int, default=0)
    p.add_argument("--tree-step-chars", type=int, default=0)
    p.add_argument("--tree-kind-chars", type=int, default=0)
    a = p.parse_args()
    name = "n" * a.long_name if a.long_name else a.tensor
    state = {name: np.arange(int(a.mib * (1 << 20)) // 4, dtype=np.float32)}
    if a.error_chars:
        from collective.transport import rawtcp
        from collective.transport.grpc import servicer, wire

        def whole(value, limit=0):
            return str(value)

        rawtcp.printable = servicer.printable = wire.printable = whole  # the sender's cut removed

        def failing(self, *args, **kwargs):
            raise E.ProtocolError("E" * a.error_chars, culprit="c" * a.error_field_chars or None,
                                  phase="p" * a.error_field_chars or None)
            yield  # a generator, as Chunker.frames is

        Chunker.frames = failing
    if a.tree_step_chars or a.tree_kind_chars:
        import json

        from collective.snapshot import tree

        def hostile(skeleton, step):
            if a.tree_kind_chars:
                skeleton = {"d": [["w", skeleton["d"][0][1]], ["x", {"K" * a.tree_kind_chars: 1}]]}
            if a.tree_step_chars:
                step = "\x1b[2J" + "S" * a.tree_step_chars
            return np.frombuffer(json.dumps({"format": tree.FORMAT, "step": step, "tree": skeleton}).encode(),
                                 dtype=np.uint8)

        tree.encode = hostile
    pub = collective.publish(state, step=a.step, bind="127.0.0.1:0", name="h0")
    serve(pub, a.address_file, a.step)


if __name__ == "__main__":
    main()
