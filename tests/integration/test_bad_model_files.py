"""Hostile and mistaken ``--model`` files given to a real chief (one under mpiexec): each ends in
one line naming the file and exit 2, within bounded memory, never a traceback or a hang."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.integration.test_mpi import mpirun
from tests.procs import ROOT, memory_limit

pytestmark = pytest.mark.integration

ONE_GIB = 1 << 30
BIG = "9" * 5000  # past the 4,300 digits Python reads from text


def only_line(chief, timeout: float = 60) -> str:
    """The chief's one output line, once it has exited 2."""
    code = chief.wait(timeout)
    lines = [ln for ln in chief.output().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, (code, chief.output()[-3000:])
    return lines[0]


def alias_bomb(levels: int) -> str:
    """A spec whose ``trainable:`` is a mapping of nested aliases: ``a`` holds 9 values, ``b``
    9 aliases of ``a``, ... 9**levels values once expanded, in about 50 bytes a level."""
    lines = ["variables:", "  - name: w", "    shape: [1]", "    dtype: float32", "    initializer: zeros",
             "    trainable:", "      a: &a [" + ", ".join(["x"] * 9) + "]"]
    for i in range(1, levels):
        name, prev = "abcdefghij"[i], "abcdefghij"[i - 1]
        lines.append(f"      {name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("levels", "size"), [(8, 478), (9, 527)])
def test_a_yaml_alias_bomb_is_refused_in_one_line_within_1_gib(tmp_path, cluster, levels, size):
    """Issue 28 item 5: the 486-byte spec took 1.6 GB and 12 s to refuse (its value formatted
    whole in the message), the 537-byte one a MemoryError traceback; these are the same specs
    a few bytes shorter. Under a 1 GiB address space either would end in MemoryError."""
    text = alias_bomb(levels)
    assert len(text) == size
    model = tmp_path / "bomb.yaml"
    model.write_text(text)
    line = only_line(cluster.chief("--workers", "1", "--model", str(model), wait_port=False,
                                   wrapper=memory_limit(ONE_GIB)))
    assert f"{model}: invalid YAML at line" in line and "aliases expand the document's" in line, line
    assert len(line) < 400, line


def _text(tmp_path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return name


def _safetensors(tmp_path, name: str, field: str) -> str:
    raw = ('{"w": {"dtype": "F32", ' + field + "}}").encode()
    (tmp_path / name).write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 4)
    return name


def _index(tmp_path, name: str) -> str:
    _safetensors(tmp_path, "model-1.safetensors", '"shape": [1], "data_offsets": [0, 4]')
    return _text(tmp_path, name, '{"metadata": {"total_size": ' + BIG + '}, "weight_map": {"w": "model-1.safetensors"}}')


_SPEC = "variables:\n  - name: w\n    shape: [{shape}]\n    dtype: float32\n    initializer: zeros\n"
_JSON_SPEC = '{"variables": [{"name": "w", "shape": [SHAPE], "dtype": "float32", "initializer": "zeros"}]}'
_SAYS = "integer 999999999999... has 5000 characters, more than the 4300 a number here may have"

# (id, writes the file in tmp_path and returns its name, what the line says)
_BIG_NUMBERS = [
    ("yaml-shape", lambda t: _text(t, "m.yaml", _SPEC.format(shape=BIG)), f"invalid YAML at line 3, column 13: {_SAYS}"),
    ("yaml-seed", lambda t: _text(t, "m.yaml", f"seed: {BIG}\n" + _SPEC.format(shape=1)),
     f"invalid YAML at line 1, column 7: {_SAYS}"),
    # Read without complaint (a power-of-two base has no digit limit), then no message could print it.
    ("yaml-hex-shape", lambda t: _text(t, "m.yaml", _SPEC.format(shape="0x" + "f" * 4000)),
     "variable 'w': shape [<an integer of 4817 digits>] has dimension <an integer of 4817 digits>"),
    ("json-shape", lambda t: _text(t, "m.json", _JSON_SPEC.replace("SHAPE", BIG)), f"invalid JSON: {_SAYS}"),
    ("safetensors-shape", lambda t: _safetensors(t, "m.safetensors", f'"shape": [{BIG}], "data_offsets": [0, 4]'),
     f"corrupt safetensors header ({_SAYS})"),
    ("safetensors-offsets", lambda t: _safetensors(t, "m.safetensors", f'"shape": [1], "data_offsets": [0, {BIG}]'),
     f"corrupt safetensors header ({_SAYS})"),
    ("index", lambda t: _index(t, "model.safetensors.index.json"), f"corrupt index ({_SAYS})"),
]


@pytest.mark.parametrize(("write", "says"), [c[1:] for c in _BIG_NUMBERS], ids=[c[0] for c in _BIG_NUMBERS])
def test_a_number_past_4300_digits_is_one_line_naming_the_file(tmp_path, cluster, write, says):
    """Issue 28 item 6: each was a ValueError traceback, exit 1."""
    model = tmp_path / write(tmp_path)
    line = only_line(cluster.chief("--workers", "1", "--model", str(model), wait_port=False))
    assert f"{model}: " in line and says in line, line
    assert len(line) < 400, line


@pytest.mark.mpi
def test_a_number_past_4300_digits_under_mpiexec_ends_every_rank_with_exit_2_naming_the_file(tmp_path):
    """Issue 28 item 6: rank 0 logged the traceback and aborted the job with exit code 1."""
    model = tmp_path / _safetensors(tmp_path, "m.safetensors", f'"shape": [{BIG}], "data_offsets": [0, 4]')
    proc = mpirun(2, "--model", str(model))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "unexpected error" not in out, out[-3000:]
    named = [ln for ln in out.splitlines() if f"{model}: corrupt safetensors header ({_SAYS})" in ln]
    assert named and all(len(ln) < 500 for ln in named), out[-3000:]


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_model_that_is_no_regular_file_is_refused_before_it_is_opened(tmp_path, cluster, kind):
    """Issue 28 item 8: a FIFO blocked the chief's read for ever; /dev/zero behind a spec's name
    is read until memory runs out (a MemoryError traceback under 1 GiB)."""
    if kind == "fifo":
        model, says = tmp_path / "model.yaml", "is a FIFO (named pipe), not a regular file"
        os.mkfifo(model)
    elif kind == "device":
        model, says = tmp_path / "model.yaml", "is a character device, not a regular file"
        model.symlink_to("/dev/zero")
    else:
        model, says = tmp_path / "notes", "is a directory without a *.safetensors.index.json or model.safetensors"
        model.mkdir()
        (model / "README").write_text("not a checkpoint\n")
    line = only_line(cluster.chief("--workers", "1", "--model", str(model), wait_port=False,
                                   wrapper=memory_limit(ONE_GIB)), timeout=30)
    assert f"model {str(model)!r}: {says}" in line, line


def _port_file_chief(port_file: str, *prefix: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
    cmd = [*prefix, sys.executable, "-m", "collective.chief", "--workers", "1", "--model", "mlp",
           "--bind", "127.0.0.1:0", "--join-timeout", "20", "--port-file", port_file]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env, stdin=subprocess.DEVNULL)


def _refused(proc: subprocess.CompletedProcess, port_file: str, cause: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    errors = [ln for ln in out.splitlines() if " ERROR " in ln]
    assert len(errors) == 1 and f"--port-file {port_file}: cannot write it: {cause}" in errors[0], out[-3000:]


def test_a_port_file_in_a_missing_directory_is_one_line_and_exit_2(tmp_path):
    port_file = str(tmp_path / "nowhere" / "chief.port")
    _refused(_port_file_chief(port_file), port_file, "No such file or directory")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="mounting a full tmpfs needs root and unshare")
def test_a_port_file_on_a_full_disk_is_one_line_and_exit_2(tmp_path):
    """Issue 28 item 8: ENOSPC ended in a traceback. The disk is a one-page tmpfs, filled, in a
    mount namespace of the chief's own (gone with it)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    port_file = str(disk / "chief.port")
    fill = f'mount -t tmpfs -o size=4k tmpfs "{disk}" && {{ head -c 65536 /dev/zero > "{disk}/fill"; exec "$@"; }}'
    proc = _port_file_chief(port_file, "unshare", "-m", "sh", "-c", fill, "sh")
    _refused(proc, port_file, "No space left on device")


def test_a_port_file_that_is_no_regular_file_is_refused_before_it_is_replaced(tmp_path):
    """It was replaced by a regular file (a FIFO's reader never told; as root, /dev/full gone)."""
    port_file = tmp_path / "chief.port"
    os.mkfifo(port_file)
    proc = _port_file_chief(str(port_file))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert f"--port-file {port_file}: is not a regular file" in out and port_file.is_fifo(), out[-3000:]
