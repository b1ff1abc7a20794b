"""Regenerate ``collective/_proto`` from ``protos/collective.proto`` (``make proto``).

grpc_tools writes ``import collective_pb2`` into the service module, which only works when the
output folder is on sys.path; we rewrite it to a package import so the generated code can be
committed inside the package.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "protos" / "collective.proto"
OUT = ROOT / "collective" / "_proto"
FILES = ("collective_pb2.py", "collective_pb2.pyi", "collective_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Write the generated modules into ``out_dir``. Raises RuntimeError if protoc fails."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO.parent}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO),
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed on {PROTO} (exit {rc})")
    grpc_file = out_dir / "collective_pb2_grpc.py"
    text = grpc_file.read_text()
    text = text.replace(
        "import collective_pb2 as collective__pb2",
        "from collective._proto import collective_pb2 as collective__pb2",
    )
    grpc_file.write_text(text)


def stale_files() -> list[str]:
    """Names of committed generated files that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        return [
            name
            for name in FILES
            if not (OUT / name).exists() or (OUT / name).read_bytes() != (Path(tmp) / name).read_bytes()
        ]


def main() -> int:
    generate(OUT)
    (OUT / "__init__.py").touch()
    print(f"generated {', '.join(FILES)} in {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
