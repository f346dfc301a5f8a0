"""Generate the Python gRPC code for proto/ into services/store/pb (committed; tests/services/test_proto.py
regenerates into a temp folder and requires identical files, so the code always matches the .proto).

    .venv/bin/python proto/generate.py            # rewrite services/store/pb
    .venv/bin/python proto/generate.py OUT_DIR    # write elsewhere (the test does)

protoc writes imports relative to the proto root (`from redknot.store.v1 import ...`); the one rewrite below
makes them package-relative so the generated modules live inside `services.store.pb`."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PROTO = "redknot/store/v1/artifact_store.proto"
DEFAULT_OUT = ROOT.parent / "services" / "store" / "pb"
FILES = ("artifact_store_pb2.py", "artifact_store_pb2.pyi", "artifact_store_pb2_grpc.py")


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    import grpc_tools
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".gen"
    tmp.mkdir(exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                      f"--grpc_python_out={tmp}", str(ROOT / PROTO)])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    written = []
    for name in FILES:
        src = tmp / Path(PROTO).parent / name
        text = src.read_text().replace("from redknot.store.v1 import artifact_store_pb2",
                                       "from . import artifact_store_pb2")
        (out / name).write_text(text)
        src.unlink()
        written.append(out / name)
    for d in sorted(tmp.rglob("*"), reverse=True):
        d.rmdir() if d.is_dir() else d.unlink()
    tmp.rmdir()
    init = out / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated from proto/redknot/store/v1/artifact_store.proto by proto/generate.py."""\n')
    return written


if __name__ == "__main__":
    for p in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT):
        print(p)
