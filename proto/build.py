"""Generate the Python code of the specd .proto files with grpcio-tools.

    python -m specd.proto.build            # regenerate proto/specd/v1/*_pb2*.py in place
    python -m specd.proto.build --out DIR  # write to DIR/specd/v1/ instead (the staleness test uses this)

protoc names the generated modules after the proto package (`specd.v1`), so the gRPC stubs would say
`from specd.v1 import serving_pb2`; inside this repository that package lives under `proto/`, so the
imports are rewritten to `from specd.proto.specd.v1 import ...`. The generated code is committed: running the
server needs no grpcio-tools, and tests/proto/test_generated_fresh.py fails when it is stale.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = ["specd/v1/serving.proto", "specd/v1/replay.proto"]
# "from specd.v1 import x_pb2" in gRPC stubs and in modules importing another .proto of ours
_IMPORT_FROM = re.compile(r"^from specd(\.\S+)? import ", re.MULTILINE)


def _fix_imports(text: str) -> str:
    return _IMPORT_FROM.sub(lambda m: f"from specd.proto.specd{m.group(1) or ''} import ", text)


def generated_files(out_root: Path) -> list[Path]:
    """Every generated file under out_root, in a stable order."""
    found: list[Path] = []
    for proto in PROTO_FILES:
        stem = out_root / Path(proto).with_suffix("")
        found += [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2_grpc.py")]
    return found


def generate(out_root: Path) -> list[Path]:
    """Run protoc over PROTO_FILES into out_root (a directory playing the role of proto/)."""
    from grpc_tools import protoc

    try:
        from importlib.resources import files

        include = str(files("grpc_tools") / "_proto")
    except (ImportError, TypeError):
        include = str(Path(protoc.__file__).parent / "_proto")
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        *PROTO_FILES,
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}: {' '.join(args)}")
    files_out = generated_files(out_root)
    for path in files_out:
        path.write_text(_fix_imports(path.read_text()))
    return files_out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None, help="output root (default: proto/ in place)")
    args = parser.parse_args(argv)
    if args.out is None:
        # generate beside a temp dir first so a protoc failure leaves the committed code untouched
        with tempfile.TemporaryDirectory() as tmp:
            for path in generate(Path(tmp)):
                target = PROTO_ROOT / path.relative_to(tmp)
                target.write_text(path.read_text())
                print(f"wrote {target}")
    else:
        for path in generate(args.out):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
