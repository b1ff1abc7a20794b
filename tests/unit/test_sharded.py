"""Sharded Hugging Face checkpoints as a model source: an index beside its shards."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from collective.errors import ModelError
from collective.sources import ShardedSafetensorsSource, load_source


def values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "model.embed.weight": rng.standard_normal((7, 5)).astype(np.float32),
        "model.layers.0.w": rng.standard_normal((3, 3)).astype(np.float16),
        "model.layers.0.b": np.arange(3, dtype=np.int64),
        "model.layers.1.w": rng.standard_normal((2, 9)).astype(np.float64),
        "lm_head.weight": rng.standard_normal((5,)).astype(np.float32),
    }


def write_sharded(directory: Path, arrays: dict[str, np.ndarray], shards: int = 2,
                  index_name: str = "model.safetensors.index.json") -> tuple[Path, dict]:
    """Shards named as Hugging Face names them, tensors dealt round-robin; the index lists
    them in ``arrays``' order."""
    directory.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {name: names[i % shards] for i, name in enumerate(arrays)}
    for shard in names:
        save_file({n: a for n, a in arrays.items() if weight_map[n] == shard}, directory / shard)
    index = {"metadata": {"total_size": sum(a.nbytes for a in arrays.values())}, "weight_map": weight_map}
    path = directory / index_name
    path.write_text(json.dumps(index))
    return path, index


def check_values(source, arrays: dict[str, np.ndarray]) -> None:
    specs = source.specs()
    assert [s.name for s in specs] == list(arrays)
    for spec in specs:
        out = np.empty(spec.shape, dtype=spec.np_dtype)
        source.fill(spec, out)
        np.testing.assert_array_equal(out, arrays[spec.name])
        assert out.dtype == arrays[spec.name].dtype


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_every_shard_is_read_in_the_index_order(tmp_path, shards):
    arrays = values()
    path, _ = write_sharded(tmp_path / "ckpt", arrays, shards)
    source = load_source(path)
    assert isinstance(source, ShardedSafetensorsSource)
    check_values(source, arrays)
    assert len(source.shards) == shards


def test_a_directory_with_an_index_is_the_sharded_checkpoint(tmp_path):
    arrays = values()
    path, _ = write_sharded(tmp_path / "ckpt", arrays, 2)
    source = load_source(path.parent)
    check_values(source, arrays)
    assert source.description.endswith("model.safetensors.index.json")


def test_a_directory_with_one_model_safetensors(tmp_path):
    arrays = values()
    (tmp_path / "ckpt").mkdir()
    save_file(arrays, tmp_path / "ckpt" / "model.safetensors")
    source = load_source(tmp_path / "ckpt")
    assert source.description.endswith("model.safetensors")
    assert {s.name for s in source.specs()} == set(arrays)


def raises(ref, *fragments: str) -> str:
    with pytest.raises(ModelError) as info:
        load_source(ref)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def test_a_directory_without_a_checkpoint(tmp_path):
    raises(tmp_path, "is a directory without a *.safetensors.index.json or model.safetensors")


def test_two_indexes_in_a_directory_are_refused(tmp_path):
    write_sharded(tmp_path, values(), 2)
    write_sharded(tmp_path, values(), 2, index_name="other.safetensors.index.json")
    raises(tmp_path, "holds 2 indexes", "name the one to serve")


def test_a_missing_shard_names_the_file(tmp_path):
    path, _ = write_sharded(tmp_path, values(), 3)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    raises(path, "model-00002-of-00003.safetensors: missing shard", "model.layers.0.w",
           "download every shard beside the index")


def test_a_tensor_the_shard_does_not_hold(tmp_path):
    path, index = write_sharded(tmp_path, values(), 2)
    index["weight_map"]["extra.bias"] = "model-00001-of-00002.safetensors"
    path.write_text(json.dumps(index))
    raises(path, "model-00001-of-00002.safetensors: does not hold tensor 'extra.bias'",
           "model.safetensors.index.json puts there")


def test_a_tensor_the_index_does_not_list(tmp_path):
    path, index = write_sharded(tmp_path, values(), 2)
    del index["weight_map"]["lm_head.weight"]
    path.write_text(json.dumps(index))
    raises(path, "holds 1 tensor(s)", "does not list for it (first 'lm_head.weight')")


def test_a_tensor_moved_to_the_wrong_shard(tmp_path):
    path, index = write_sharded(tmp_path, values(), 2)
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    path.write_text(json.dumps(index))
    raises(path, "model-00002-of-00002.safetensors: does not hold tensor 'lm_head.weight'")


def test_duplicate_names_in_the_index(tmp_path):
    path, index = write_sharded(tmp_path, values(), 2)
    text = json.dumps(index).replace('"weight_map": {', '"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors", ')
    path.write_text(text)
    raises(path, "model.safetensors.index.json: corrupt index (duplicate key 'lm_head.weight')")


@pytest.mark.parametrize("shard", ["../model-00001-of-00002.safetensors", "/etc/model.safetensors",
                                   "sub/../../x.safetensors"])
def test_a_shard_outside_the_directory(tmp_path, shard):
    path, index = write_sharded(tmp_path / "ckpt", values(), 2)
    index["weight_map"]["lm_head.weight"] = shard
    path.write_text(json.dumps(index))
    raises(path, f"shard {shard!r} is outside the index's directory")


@pytest.mark.parametrize("text,expected", [
    ("{}", 'needs a non-empty "weight_map"'),
    ('{"weight_map": []}', 'needs a non-empty "weight_map"'),
    ("{not json", "corrupt index"),
    ('{"weight_map": {"a": 3}}', "shard 3 is not a .safetensors file name"),
])
def test_a_bad_index(tmp_path, text, expected):
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(text)
    raises(path, "model.safetensors.index.json", expected)


def test_a_bad_shard_names_the_shard(tmp_path):
    path, _ = write_sharded(tmp_path, values(), 2)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3])
    raises(path, "model-00002-of-00002.safetensors", "truncated")


@pytest.mark.parametrize("link", ["directory", "file"])
def test_a_shard_a_symbolic_link_leads_out_of_the_index_directory_is_refused_naming_it(tmp_path, link):
    """Issue 28 item 8: ``sub -> /elsewhere`` made ``sub/x.safetensors`` a shard the chief served."""
    path, index = write_sharded(tmp_path / "ckpt", values(), 2)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shard = "model-00002-of-00002.safetensors"
    (path.parent / shard).rename(elsewhere / shard)
    if link == "directory":
        (path.parent / "sub").symlink_to(elsewhere)
        named = f"sub/{shard}"
    else:
        (path.parent / "linked.safetensors").symlink_to(elsewhere / shard)
        named = "linked.safetensors"
    index["weight_map"] = {k: named if v == shard else v for k, v in index["weight_map"].items()}
    path.write_text(json.dumps(index))
    raises(path, f"ckpt/{named}: shard of {path} resolves to {elsewhere / shard}, outside the index's directory")


def test_a_shard_linked_within_the_index_directory_is_served(tmp_path):
    arrays = values()
    path, index = write_sharded(tmp_path / "ckpt", arrays, 2)
    (path.parent / "sub").mkdir()
    shard = "model-00002-of-00002.safetensors"
    (path.parent / shard).rename(path.parent / "sub" / shard)
    (path.parent / shard).symlink_to(Path("sub") / shard)
    check_values(load_source(path), arrays)


def test_a_hugging_face_cache_snapshot_is_served(tmp_path):
    """The hub's cache links the index and every shard of ``snapshots/<rev>/`` to ``blobs/``:
    shards resolve beside the file the index links to, not beside the link."""
    arrays = values()
    path, index = write_sharded(tmp_path / "blobs", arrays, 2)
    snapshot = tmp_path / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name in [path.name, *set(index["weight_map"].values())]:
        (snapshot / name).symlink_to(Path("../..") / "blobs" / name)
    check_values(load_source(snapshot), arrays)


def test_a_shard_that_is_a_fifo_is_refused_naming_it(tmp_path):
    path, _ = write_sharded(tmp_path, values(), 2)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    raises(path, f"{shard}: shard of {path} is a FIFO (named pipe), not a regular file")
