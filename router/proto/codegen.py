"""Generate the Python modules for `generate.proto` with grpcio-tools.

Run by the build (`make` install targets, the Dockerfile) and, as a fallback, on first import
of the gRPC server when the generated files are missing or older than the .proto. The outputs
(`generate_pb2.py`, `generate_pb2_grpc.py`, `generate_pb2.pyi`) are not in git.

    python -m router.proto.codegen
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "generate.proto"
OUTPUTS = [HERE / "generate_pb2.py", HERE / "generate_pb2_grpc.py"]


def is_stale() -> bool:
    mtime = PROTO.stat().st_mtime
    return any(not p.exists() or p.stat().st_mtime < mtime for p in OUTPUTS)


def generate() -> None:
    import grpc_tools
    from grpc_tools import protoc

    root = HERE.parent.parent  # the folder holding the `router` package
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{well_known}",
        f"--python_out={root}",
        f"--pyi_out={root}",
        f"--grpc_python_out={root}",
        str(PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"grpc_tools.protoc failed on {PROTO}")


def ensure() -> None:
    if is_stale():
        generate()


if __name__ == "__main__":
    generate()
    print(f"generated {', '.join(p.name for p in OUTPUTS)}", file=sys.stderr)
