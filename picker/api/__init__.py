"""picker's own gRPC API (protos/picker/api/v1).

The stubs in picker/api/v1 are generated, never committed: a wheel or sdist build compiles them (setup.py's build
hook), and so does an editable install; `make protos` refreshes them in a checkout after the .proto changes.
Nothing is compiled at import time, because an installed package may be read-only and grpcio-tools is only a
build dependency. Importing this package fails with a clear message when the stubs are missing.

Import the stubs as `from picker.api.v1 import picker_pb2, picker_pb2_grpc` after importing this package.
"""

from __future__ import annotations

import importlib.util

STUBS = ("picker.api.v1.picker_pb2", "picker.api.v1.picker_pb2_grpc")


def _check_generated() -> None:
    missing = [name for name in STUBS if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"picker's gRPC API stubs are not generated ({', '.join(missing)} missing): run "
                          "`make protos` in the source checkout (or reinstall picker, whose build compiles them)")


_check_generated()
