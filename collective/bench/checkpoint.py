"""A generated sharded Hugging Face checkpoint of any size, written in bounded memory.

``write_checkpoint(directory, size, shards)`` writes ``model-0000i-of-0000N.safetensors`` files
and their ``model.safetensors.index.json`` as the Hugging Face writers lay them out (the header
padded to 8 bytes, tensors back to back): float32 tensors of at most ``tensor_bytes`` with seeded
random bytes, each shard written a block at a time, so a 4 GiB checkpoint needs a few MiB of
memory. For ``collective bench --from-file`` and the tests of serving from the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

BLOCK = 16 << 20


def write_checkpoint(directory: Path, size: int, shards: int = 1, *, tensor_bytes: int = 64 << 20,
                     seed: int = 0) -> Path:
    """Write about ``size`` bytes of float32 tensors in ``shards`` shards; return the index's path."""
    directory.mkdir(parents=True, exist_ok=True)
    per_shard = -(-size // shards)
    rng = np.random.default_rng(seed)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        left = min(per_shard, size - s * per_shard) // 4 * 4
        header, pos, i = {}, 0, 0
        while pos < left or not header:
            n = min(tensor_bytes, left - pos) // 4
            tensor = f"model.layers.{s}.{i}.weight"
            header[tensor] = {"dtype": "F32", "shape": [n], "data_offsets": [pos, pos + 4 * n]}
            weight_map[tensor] = name
            pos, i = pos + 4 * n, i + 1
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(directory / name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for start in range(0, pos, BLOCK):
                f.write(rng.integers(0, 1 << 31, size=min(BLOCK, pos - start) // 4, dtype=np.uint32).tobytes())
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}))
    return index
