"""A bfloat16 checkpoint saved by the real torch + safetensors broadcasts bit-exact between real
chief and worker processes (gRPC and shared memory)."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import xxhash

from chief.service import materialize
from collective.digest import chunk_digests, combined_digest, worker_digest
from collective.plan import DEFAULT_CHUNK_BYTES
from collective.sources import load_source

pytestmark = pytest.mark.integration

FAST = ["--join-timeout", "30"]


def bf16_checkpoint(path) -> dict[str, bytes]:
    """A real bf16 state_dict (torch) saved with safetensors.torch; else safetensors.numpy."""
    try:
        import torch
        from safetensors.torch import save_file
    except ImportError:  # the torch extra is not installed: the numpy writer of the same format
        torch = None
    if torch is not None:
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.LayerNorm(8)).to(torch.bfloat16)
        with torch.no_grad():
            model[0].bias.view(torch.int16)[:2] = torch.tensor([0x7FC5, -0x8000], dtype=torch.int16)  # NaN payload, -0.0
        state = model.state_dict()
        save_file(state, str(path))
        return {k: v.view(torch.int16).numpy().tobytes() for k, v in state.items()}
    from safetensors.numpy import save_file as save_np

    arrays = {"w": np.array([0x7FC5, 0x8000, 0x3F80], "<u2").view(ml_dtypes.bfloat16)}
    save_np(arrays, str(path))
    return {k: a.tobytes() for k, a in arrays.items()}


def test_bf16_safetensors_checkpoint_reaches_workers_bit_exact(tmp_path, cluster):
    path = tmp_path / "model.safetensors"
    expected = bf16_checkpoint(path)
    chief = cluster.chief("--workers", "2", "--model", str(path), *FAST)
    # One worker over the network only, one through shared memory; both declare the model.
    net = cluster.worker("net", "--no-shm", "--expect-model", str(path), *FAST)
    shm = cluster.worker("shm", "--devices", "cpu:0,cpu:1", "--expect-model", str(path), *FAST)
    for p in (net, shm, chief):
        assert p.wait(60) == 0, p.output()
    result = json.loads((tmp_path / "result.json").read_text())
    variables = {v["name"]: v for v in result["variables"]}
    assert {n: v["dtype"] for n, v in variables.items()} == {n: "bfloat16" for n in expected}
    # The plan's digests are of the file's bytes; each worker verified every chunk against them.
    assert {n: v["digest"] for n, v in variables.items()} == {n: xxhash.xxh3_128_hexdigest(b) for n, b in expected.items()}
    # Each worker's digest covers the chunk digests of every replica arena it verified: the
    # digest of the file's bytes laid out as the chief lays them, once per device.
    specs, arena, _ = materialize(load_source(str(path)))
    chunks = chunk_digests(arena, DEFAULT_CHUNK_BYTES)
    manifest = combined_digest((v["name"], v["digest"]) for v in result["variables"])
    assert {w["id"]: w["digest"] for w in result["workers"]} == {
        "net": worker_digest(manifest, [chunks]), "shm": worker_digest(manifest, [chunks, chunks]),
    }
