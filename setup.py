"""Build hook: compile our gRPC API, bundle the Envoy templates and record the commit (`picker --version`) while
setuptools builds the package.

Generated stubs are never committed, and an installed package may be read-only, so the stubs have to be
produced by the build, not on first import. grpcio-tools is therefore a build requirement
(pyproject.toml's [build-system]), not a runtime one. Everything else about the project lives in pyproject.toml.
"""

from __future__ import annotations

import shutil
import sys
from importlib import resources
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PROTO_ROOT = HERE / "protos"
PROTO_GLOB = "picker/api/v1/*.proto"
# `picker envoy-config` renders these; a source checkout keeps them in envoy/ (docker-compose and the manifests
# are rendered from them too), an install carries copies in the package.
ENVOY_TEMPLATES = ("envoy.yaml", "envoy-full-duplex.yaml")
TEMPLATE_PACKAGE_DIR = Path("picker") / "envoy_templates"


def compile_protos(out: Path) -> list[Path]:
    """`python -m grpc_tools.protoc -Iprotos --python_out --pyi_out --grpc_python_out` into `out`."""
    from grpc_tools import protoc  # a build requirement: only present while building

    protos = sorted(PROTO_ROOT.glob(PROTO_GLOB))
    if not protos:
        raise RuntimeError(f"no {PROTO_GLOB} under {PROTO_ROOT}: the source tree is incomplete")
    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    out.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *map(str, protos)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"grpc_tools.protoc failed on {', '.join(p.name for p in protos)}")
    outputs = []
    for proto in protos:
        stem = out / proto.relative_to(PROTO_ROOT).with_suffix("")
        outputs += [stem.with_name(stem.name + suffix) for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    missing = [str(p) for p in outputs if not p.exists()]
    if missing:
        raise RuntimeError(f"grpc_tools.protoc did not write {', '.join(missing)}")
    return outputs


def copy_envoy_templates(build_lib: Path) -> list[Path]:
    """envoy/*.yaml into the built package, unless the tree already has them as package data (the image's
    Dockerfile copies them into picker/envoy_templates/)."""
    outputs = []
    for name in ENVOY_TEMPLATES:
        source = HERE / "envoy" / name
        target = build_lib / TEMPLATE_PACKAGE_DIR / name
        if source.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
        elif not (HERE / TEMPLATE_PACKAGE_DIR / name).exists():
            raise RuntimeError(f"Envoy template {name} is in neither envoy/ nor {TEMPLATE_PACKAGE_DIR}/")
        outputs.append(target)
    return outputs


def record_commit(build_lib: Path) -> list[Path]:
    """The checkout's commit into the built package (picker/build_commit.txt), when it is built from a git checkout
    (an sdist's tree has none: nothing is recorded)."""
    sys.path.insert(0, str(HERE))
    try:
        from picker.core.distribution import BUILD_COMMIT_FILE, git_commit  # standard library only
    finally:
        sys.path.remove(str(HERE))
    commit = git_commit(HERE) if (HERE / ".git").exists() else ""
    if not commit:
        return []
    target = build_lib / "picker" / BUILD_COMMIT_FILE
    target.write_text(commit + "\n")
    return [target]


class BuildPyWithGenerated(build_py):
    """build_py that adds the API stubs and the Envoy templates to what it builds."""

    def run(self) -> None:
        if self.editable_mode:
            # An editable install imports the source tree: stubs go next to the .proto's package, in place
            # (what `make protos` does); templates are read from envoy/ of the checkout at run time.
            compile_protos(HERE)
            super().run()
            return
        super().run()  # copies the sources (possibly with a developer's stale stubs) first...
        build_lib = Path(self.build_lib)
        self._generated = (compile_protos(build_lib) + copy_envoy_templates(build_lib)  # ...then overwrites
                           + record_commit(build_lib))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        return outputs + [str(p) for p in getattr(self, "_generated", []) if str(p) not in outputs]


setup(cmdclass={"build_py": BuildPyWithGenerated})
