"""Derive the Python code of the wire contract from the .proto sources.

    python -m splitserve.proto.generate            # rewrite splitserve/proto/v1/
    python -m splitserve.proto.generate --out DIR  # write elsewhere (the staleness test)

The sources live in `proto/splitserve/v1/*.proto` (import paths
`splitserve/v1/...`); the generated modules land in `proto/v1/` and import as
`splitserve.proto.v1.*`. protoc writes absolute imports (`from splitserve.v1
import common_pb2`) that name no real package, so they are rewritten to
package-relative ones. The code is committed, and a test fails when it differs
from what this script produces with the pinned grpcio-tools.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
SOURCE_DIR = PROTO_ROOT / "splitserve" / "v1"
OUTPUT_DIR = PROTO_ROOT / "v1"
PROTO_PACKAGE_PATH = "splitserve/v1"

INIT_TEXT = '"""Generated from proto/splitserve/v1/*.proto by `python -m splitserve.proto.generate`; do not edit."""\n'

_ABSOLUTE_IMPORT = re.compile(r"^from splitserve\.v1 import ", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules (and `__init__.py`) into `out_dir`; returns the files written."""
    from grpc_tools import protoc

    sources = sorted(SOURCE_DIR.glob("*.proto"))
    if not sources:
        raise SystemExit(f"no .proto files under {SOURCE_DIR}")
    include = Path(protoc.__file__).resolve().parent / "_proto"   # google/protobuf/*.proto
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}",
                f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                *(f"{PROTO_PACKAGE_PATH}/{s.name}" for s in sources)]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed (see its message above)")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for produced in sorted((Path(tmp) / PROTO_PACKAGE_PATH).iterdir()):
            text = _ABSOLUTE_IMPORT.sub("from . import ", produced.read_text(encoding="utf-8"))
            target = out_dir / produced.name
            target.write_text(text, encoding="utf-8")
            written.append(target)
    init = out_dir / "__init__.py"
    init.write_text(INIT_TEXT, encoding="utf-8")
    return [init, *written]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUTPUT_DIR,
                        help="output folder (default: the committed location, %(default)s)")
    args = parser.parse_args(argv)
    if args.out.resolve() == OUTPUT_DIR:
        # Start clean so a removed .proto leaves no stale module behind.
        for old in OUTPUT_DIR.glob("*_pb2*.py*"):
            old.unlink()
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
