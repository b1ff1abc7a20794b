"""The committed protobuf/gRPC modules are what `make proto` makes from protos/collective.proto."""

import subprocess
import sys

from tests.procs import ROOT


def test_generated_proto_modules_are_not_stale():
    # In a process of its own: grpc_tools' protoc loaded into a pytest process that already holds
    # TensorFlow and torch (the framework tests) crashed it with a segmentation fault.
    code = "from collective._protogen import stale_files; print(','.join(stale_files()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    stale = [name for name in proc.stdout.strip().split(",") if name]
    assert not stale, f"run `make proto` and commit: {', '.join(stale)} differ from protos/collective.proto"
