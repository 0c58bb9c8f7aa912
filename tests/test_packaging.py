"""The package as users get it: `pip install llm-picker` is the lean serving picker, the simulator and the benchmark
are extras, and the gRPC stubs and Envoy templates come from the build, so a read-only install works.

The wheel is built from an sdist of a clean copy of the sources (no generated stubs, no build/ directory): built
straight from the checkout it would carry the developer's stubs and hide a broken build hook."""

from __future__ import annotations

import gzip
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import textwrap
import tomllib
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

import picker
from picker import cli
from picker.core.distribution import git_commit

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "picker", "protos", "envoy")
GENERATED = re.compile(r"_pb2(_grpc)?\.pyi?$")
RUNTIME_FORBIDDEN = {"grpcio-tools", "matplotlib", "pyzmq"}
STUBS = ("picker/api/v1/picker_pb2.py", "picker/api/v1/picker_pb2.pyi", "picker/api/v1/picker_pb2_grpc.py")
TEMPLATES = ("picker/envoy_templates/envoy.yaml", "picker/envoy_templates/envoy-full-duplex.yaml")


def _build_tools_missing() -> str | None:
    """What keeps this environment from building picker without build isolation (read from the installed
    metadata: importing setuptools here would replace distutils under the other tests)."""
    for dist, minimum in (("setuptools", 77), ("grpcio-tools", 0), ("pip", 22)):
        try:
            major = int(metadata.version(dist).split(".")[0])
        except (metadata.PackageNotFoundError, ValueError):
            return f"{dist} is not installed (the dev extra brings it)"
        if major < minimum:
            return f"{dist} {metadata.version(dist)} is older than {minimum}"
    return None


MISSING_BUILD_TOOL = _build_tools_missing()
needs_build_tools = pytest.mark.skipif(MISSING_BUILD_TOOL is not None, reason=f"cannot build: {MISSING_BUILD_TOOL}")


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 60
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _copy_sources(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py",
                                    "envoy_templates", "*.egg-info")
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore)
        else:
            shutil.copy2(source, dest / name)


def _chmod_tree(root: Path, file_mode: int, dir_mode: int) -> None:
    """chmod every file and directory under root; symlinks are left alone (a venv's python points outside)."""
    for directory, _, files in os.walk(root):
        os.chmod(directory, dir_mode)
        for name in files:
            target = Path(directory, name)
            if not target.is_symlink():
                os.chmod(target, file_mode | (target.stat().st_mode & 0o111))


@pytest.fixture(scope="module")
def built() -> Iterator[tuple[Path, Path]]:
    """(sdist, wheel), built like `pip install llm_picker-*.tar.gz` would, in a directory removed afterwards."""
    work = Path(tempfile.mkdtemp(prefix="picker-packaging-"))
    try:
        src = work / "src"
        src.mkdir()
        _copy_sources(src)
        dist = work / "dist"
        build_sdist = f"from setuptools import build_meta; print(build_meta.build_sdist({str(dist)!r}))"
        sdist = _run([sys.executable, "-c", build_sdist], cwd=src)
        assert sdist.returncode == 0, sdist.stderr
        archive = dist / sdist.stdout.strip().splitlines()[-1]
        with tarfile.open(archive) as tar:
            tar.extractall(work / "unpacked", filter="data")
        unpacked = next((work / "unpacked").iterdir())
        wheels = work / "wheels"
        result = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                       str(wheels), "."], cwd=unpacked, timeout=120)
        assert result.returncode == 0, result.stderr
        yield archive, next(wheels.glob("llm_picker-*.whl"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


@needs_build_tools
def test_sdist_can_build_the_wheel_alone(built: tuple[Path, Path]) -> None:
    with tarfile.open(built[0]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"setup.py", "pyproject.toml", "protos/picker/api/v1/picker.proto", "envoy/envoy.yaml",
            "envoy/envoy-full-duplex.yaml"} <= names
    assert not [n for n in names if GENERATED.search(n)], "generated stubs must come from the build"


@needs_build_tools
def test_wheel_has_the_stubs_and_a_lean_runtime(built: tuple[Path, Path]) -> None:
    with zipfile.ZipFile(built[1]) as whl:
        names = set(whl.namelist())
        meta = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert set(STUBS) | set(TEMPLATES) | {"picker/py.typed", "picker/api/__init__.py"} <= names
    # the registry's `picker` is someone else's: ours is llm-picker, at the version the package says
    assert re.search(r"^Name: llm-picker$", meta, re.M) and re.search(rf"^Version: {picker.__version__}$", meta, re.M)
    assert "picker/build_commit.txt" not in names  # built from an sdist: no checkout, no commit to record
    requires = re.findall(r"^Requires-Dist: (.+)$", meta, re.M)
    runtime = {_dist_name(r) for r in requires if "extra ==" not in r}
    assert not runtime & RUNTIME_FORBIDDEN, runtime
    assert {"grpcio", "protobuf", "pydantic", "xds-protos"} <= runtime
    extras = {extra: {_dist_name(r) for r in requires if f'extra == "{extra}"' in r}
              for extra in ("kv-events", "tokenizer")}
    assert "pyzmq" in extras["kv-events"] and "tokenizers" in extras["tokenizer"]
    # what serves, and nothing of the lab: no simulator, benchmark, demo, echo backends nor process supervisor
    modules = {n.split("/")[1].removesuffix(".py") for n in names if n.startswith("picker/") and n.count("/") >= 1}
    assert {"serving", "routing", "scheduling", "extproc", "tools"} <= modules
    assert not modules & {"sim", "bench", "supervisor", "demo", "echo"}, modules
    assert not [n for n in names if n.startswith("picker_lab") or "supervisor" in n or "/demo" in n], names
    tools = {n for n in names if n.startswith("picker/tools/")}
    assert tools == {"picker/tools/__init__.py", "picker/tools/doctor.py", "picker/tools/explain.py"}, tools


def _dist_name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


@pytest.fixture(scope="module")
def read_only_venv(built: tuple[Path, Path]) -> Iterator[Path]:
    """A venv with only the wheel installed (--no-deps), its site-packages read-only. The dependencies come from
    the dev venv through a .pth path entry placed after the wheel: a plain path, so the dev venv's own .pth
    files (the editable finder of this checkout) are not run and cannot shadow the wheel."""
    venv = Path(tempfile.mkdtemp(prefix="picker-venv-"))
    try:
        assert _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=venv).returncode == 0
        python = venv / "bin" / "python"
        install = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                        "--no-index", str(built[1])], cwd=venv, timeout=120)
        assert install.returncode == 0, install.stderr
        site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         cwd=venv).stdout.strip())
        dev_paths = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
        (site / "zz_picker_test_deps.pth").write_text("".join(f"{p}\n" for p in dev_paths))
        _chmod_tree(site, 0o444, 0o555)
        yield venv
    finally:
        _chmod_tree(venv, 0o644, 0o755)
        shutil.rmtree(venv, ignore_errors=True)


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root with its size and mtime, to catch writes that permission bits do not stop."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


# Runs "$@" with directory $1 remounted read-only in a private mount namespace: a read-only file system stops
# root too, whom the chmod above does not stop.
READ_ONLY_MOUNT = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'


def _read_only_prefix(directory: Path) -> list[str]:
    """A command prefix that runs its command with `directory` mounted read-only, or [] where mount
    namespaces are not available (then chmod and the snapshot comparison do the checking)."""
    if shutil.which("unshare") is None:
        return []
    prefix = ["unshare", "-m", "sh", "-c", READ_ONLY_MOUNT, "sh", str(directory)]
    probe = _run([*prefix, "sh", "-c", f"! touch {directory}/probe 2>/dev/null"], cwd=directory)
    return prefix if probe.returncode == 0 else []


@needs_build_tools
def test_read_only_install_serves_and_explains(read_only_venv: Path, tmp_path: Path) -> None:
    bin_dir = read_only_venv / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1")
    ro = _read_only_prefix(read_only_venv)
    before = _snapshot(read_only_venv)
    where = _run([*ro, str(bin_dir / "python"), "-c", "import picker.api, picker; from picker.api.v1 import "
                  "picker_pb2_grpc; from picker.serving.envoyconfig import template_path; "
                  "print(picker.__file__); print(template_path('full-duplex'))"], cwd=tmp_path, env=env)
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(read_only_venv)) for line in where.stdout.split()), where.stdout
    for command in (["serve", "--help"], ["explain", "--help"], ["doctor", "--help"]):
        result = _run([*ro, str(bin_dir / "picker"), *command], cwd=tmp_path, env=env)
        assert result.returncode == 0 and "usage: picker" in result.stdout, result.stderr
    version = _run([*ro, str(bin_dir / "picker"), "--version"], cwd=tmp_path, env=env)
    assert version.returncode == 0 and version.stdout == f"llm-picker {picker.__version__}\n", version.stderr
    rendered = _run([*ro, str(bin_dir / "picker"), "envoy-config", "--pool", "127.0.0.1:8001"], cwd=tmp_path,
                    env=env)
    assert rendered.returncode == 0 and "127.0.0.1" in rendered.stdout, rendered.stderr
    lab = _run([*ro, str(bin_dir / "picker"), "sim", "--help"], cwd=tmp_path, env=env)
    assert lab.returncode == 1 and "part of the lab" in lab.stderr and "pip install -e lab" in lab.stderr, lab
    assert _snapshot(read_only_venv) == before, "running the installed picker wrote into its venv"


def test_package_without_stubs_says_run_make_protos(tmp_path: Path) -> None:
    for module in ("picker/__init__.py", "picker/api/__init__.py", "picker/api/v1/__init__.py"):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / module, tmp_path / module)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}
    result = _run([sys.executable, "-c", "import picker.api"], cwd=tmp_path, env=env)
    assert result.returncode != 0 and "ImportError" in result.stderr and "make protos" in result.stderr
    assert not list((tmp_path / "picker/api/v1").glob("*_pb2*")), "nothing may be compiled at import time"


# A subprocess in which some modules cannot be imported, as if their packages were not installed.
BLOCKER = textwrap.dedent("""
    import sys
    BLOCKED = {blocked!r}

    class Blocker:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, Blocker)
""")


def _run_blocked(blocked: tuple[str, ...], code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-c", BLOCKER.format(blocked=blocked) + textwrap.dedent(code)], cwd=cwd)


@pytest.mark.parametrize(("command", "blocked", "hint"), [
    ("sim", "picker_lab", "pip install -e lab"), ("bench", "picker_lab", "pip install -e 'lab[bench]'"),
    ("demo", "zmq", "pip install -e lab"), ("bench", "matplotlib", "pip install -e 'lab[bench]'")])
def test_a_lab_command_without_the_lab_says_how_to_install_it(command: str, blocked: str, hint: str,
                                                             tmp_path: Path) -> None:
    result = _run_blocked((blocked,), f"""
        from picker.cli import main
        sys.exit(main([{command!r}, "--help"]))
    """, tmp_path)
    assert result.returncode != 0 and result.stdout == ""
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert hint in result.stderr and blocked in result.stderr


def test_serving_needs_no_extra_nor_simulator(tmp_path: Path) -> None:
    """serve, explain and envoy-config import neither the simulator, the benchmark, nor any extra's package."""
    result = _run_blocked(("picker_lab", "zmq", "matplotlib", "grpc_tools", "tokenizers"), """
        import picker.serving.server, picker.tools.explain, picker.serving.envoyconfig, picker.api.service
        from picker.cli import main
        for command in ("serve", "explain", "envoy-config"):
            try:
                main([command, "--help"])
            except SystemExit as exc:
                assert exc.code == 0, (command, exc.code)
        print("ok")
    """, tmp_path)
    assert result.returncode == 0 and result.stdout.rstrip().endswith("ok"), result.stderr


def test_kv_events_without_their_extra_is_a_config_error_naming_it(tmp_path: Path) -> None:
    result = _run_blocked(("zmq",), """
        from picker.cli import main
        sys.exit(main(["serve", "--endpoints", "127.0.0.1:1", "--kv-events-endpoint", "tcp://127.0.0.1:1"]))
    """, tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert "kv-events-endpoint" in result.stderr and "pip install 'llm-picker[kv-events]'" in result.stderr


def test_the_lab_commands_need_what_the_lab_installs() -> None:
    """picker.cli's modules of each lab command are installed by lab/pyproject.toml (its dependencies or the
    named extra)."""
    project = tomllib.loads((ROOT / "lab" / "pyproject.toml").read_text())["project"]
    owners = metadata.packages_distributions()
    for command, (extra, modules) in cli.LAB.items():
        assert command in cli.SUBCOMMANDS and cli.SUBCOMMANDS[command][0].startswith("picker_lab.")
        wanted = {_dist_name(r) for r in project["dependencies"] + project["optional-dependencies"].get(extra, [])}
        wanted.add(project["name"])
        for module in modules:
            dists = {d.lower().replace("_", "-") for d in owners.get(module, [])}
            assert dists & wanted or module == "picker_lab", f"{command}: {module} is not installed by the lab"


def test_the_license_is_an_spdx_string_not_a_deprecated_table() -> None:
    """`project.license = {text = ...}` makes every `pip install` warn twice; an SPDX expression does not."""
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"


def test_a_checkout_names_its_commit_in_the_version() -> None:
    """`picker --version` from this editable install: the version and the checkout's commit."""
    result = _run([sys.executable, "-m", "picker", "--version"], cwd=ROOT)
    assert result.returncode == 0, result.stderr
    commit = git_commit(ROOT)
    assert result.stdout == f"llm-picker {picker.__version__}" + (f" (commit {commit})" if commit else "") + "\n"


def test_no_file_tells_users_to_install_someone_elses_picker() -> None:
    """The registry's `picker` is an unrelated project: nothing the repository ships may tell users to install it."""
    tracked = _run(["git", "ls-files"], cwd=ROOT)
    files = tracked.stdout.split() if tracked.returncode == 0 else [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                                                                    if p.is_file() and ".venv" not in p.parts]
    wrong = re.compile(r"pip install ['\"]?picker(\[|['\"\s`]|$)", re.M)
    said = [name for name in files if not name.startswith("bench/results/") and Path(ROOT / name).is_file()
            and wrong.search((ROOT / name).read_text(errors="replace"))]
    assert said == []


def test_committed_results_hold_no_machine_paths_nor_crash_logs() -> None:
    """What bench/results keeps is read by others: no path of the machine it ran on, no Python traceback."""
    tracked = _run(["git", "ls-files", "bench/results"], cwd=ROOT)
    files = tracked.stdout.split() if tracked.returncode == 0 else [
        str(p.relative_to(ROOT)) for p in (ROOT / "bench" / "results").rglob("*") if p.is_file()]
    machine_path = re.compile(r"(?<![\w.])/(?:work|tmp|home|root)/[\w.-]")
    found = []
    for name in files:
        if name.endswith((".png", ".svg")):
            continue
        data = (ROOT / name).read_bytes()
        text = (gzip.decompress(data) if name.endswith(".gz") else data).decode(errors="replace")
        if machine_path.search(text) or "Traceback (most recent call last)" in text:
            found.append(name)
    assert found == []


def test_committed_results_stay_small() -> None:
    """bench/results keeps reports, summaries and plots (per-request rows stay in a run's bench/out; the JSON kept
    is compressed): a clone does not carry megabytes of benchmark output."""
    tracked = _run(["git", "ls-files", "bench/results"], cwd=ROOT)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    names = tracked.stdout.split()
    assert sum((ROOT / n).stat().st_size for n in names if (ROOT / n).is_file()) < 2_000_000
    assert not [n for n in names if n.endswith(".json")], "keep result JSON compressed (.json.gz)"


def test_code_says_why_not_which_numbered_decision() -> None:
    """Comments and docstrings say why; which decision changed what is docs/decisions.md's to tell."""
    numbered = re.compile(r"[Dd]ecision #?\d+|decisions\.md, \d+|\(was \d")
    sources = [*ROOT.glob("picker/**/*.py"), *ROOT.glob("bench/*.py"), *ROOT.glob("tests/*.py")]
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sources if p.name != "test_packaging.py"
             for n, line in enumerate(p.read_text().splitlines(), 1) if numbered.search(line)]
    assert not found, found
