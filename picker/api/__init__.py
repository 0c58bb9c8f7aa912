"""picker's own gRPC API (protos/picker/api/v1). Generated modules are built by `make protos`, or here on
first import when missing or stale (grpcio-tools is a runtime dependency), so they never drift from the .proto.

Import the stubs as `from picker.api.v1 import picker_pb2, picker_pb2_grpc` after importing this package.
"""

from __future__ import annotations

import importlib
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_PROTO = _ROOT / "protos" / "picker" / "api" / "v1" / "picker.proto"
_OUT = Path(__file__).resolve().parent / "v1"


def _generate() -> None:
    from grpc_tools import protoc  # imported lazily: only needed when stubs are missing or stale

    if not _PROTO.exists():
        raise ImportError(f"picker API stubs are missing and {_PROTO} was not found: run `make protos`")
    args = ["protoc", f"-I{_ROOT / 'protos'}", f"--python_out={_ROOT}", f"--pyi_out={_ROOT}",
            f"--grpc_python_out={_ROOT}", str(_PROTO)]
    if protoc.main(args) != 0:
        raise ImportError(f"grpc_tools.protoc failed on {_PROTO}")


def ensure_generated() -> None:
    """Compile the stubs if absent or older than the .proto."""
    generated = _OUT / "picker_pb2_grpc.py"
    if not generated.exists() or (_PROTO.exists() and _PROTO.stat().st_mtime > generated.stat().st_mtime):
        _generate()
        importlib.invalidate_caches()


ensure_generated()
