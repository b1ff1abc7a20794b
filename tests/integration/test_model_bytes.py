"""The summary's "bytes in the model" counts the model's variables, whatever serves them: from
a model's files (``collective launch --from-file``) the arena holds their headers too."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from collective.sources import save_safetensors

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("from_file", [True, False], ids=["from-file", "copy"])
def test_bytes_in_the_model_leave_out_the_files_header(tmp_path, from_file):
    model = tmp_path / "m.safetensors"
    save_safetensors(model, {"a": np.arange(68_000, dtype=np.float32), "b": np.ones((3, 5), np.int64)})
    want = 68_000 * 4 + 15 * 8  # 272,120 bytes; the file is larger by its header
    assert model.stat().st_size > want
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
    run = subprocess.run([sys.executable, "-m", "collective.cli", "launch", "--workers", "1", "--model", str(model),
                          "--from-file" if from_file else "--no-from-file", "--quiet"],
                         capture_output=True, text=True, timeout=110, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    # Before, with --from-file: "bytes 272,256 (265.9 KiB) in the model" (the file's size).
    assert f"  bytes       {want:,} (265.7 KiB) in the model\n" in run.stdout, run.stdout
