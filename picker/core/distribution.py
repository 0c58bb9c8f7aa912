"""What this installation of the picker is: its distribution's name and version, the commit it was built from, and
the source tree of an editable install.

The distribution is `llm-picker` (the registry's `picker` is someone else's project); the command stays `picker`.
"""

from __future__ import annotations

import json
import subprocess
import urllib.parse
from importlib import metadata, resources
from pathlib import Path

import picker

DIST_NAME = "llm-picker"
BUILD_COMMIT_FILE = "build_commit.txt"  # written into a built wheel by setup.py's build hook (a git checkout only)


def editable_checkout() -> Path | None:
    """The source tree of the editable install (`pip install -e`) this package runs from, as pip records it
    (PEP 610); None for a regular install. Other installs on sys.path (another venv's editable one, a stray
    .egg-info) are not this package and are skipped."""
    package = Path(picker.__file__).resolve().parent
    for dist in metadata.distributions(name=DIST_NAME):
        try:
            info = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            continue
        url = urllib.parse.urlparse(str(info.get("url", "")))
        if isinstance(info.get("dir_info"), dict) and info["dir_info"].get("editable") and url.scheme == "file":
            tree = Path(urllib.parse.unquote(url.path))
            if (tree / "picker").resolve() == package:
                return tree
    return None


def git_commit(tree: Path) -> str:
    """The short commit of a git checkout, with "-dirty" when it has uncommitted changes; "" when `tree` is no
    checkout or git is missing."""
    try:
        commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, timeout=10)
        if commit.returncode != 0:
            return ""
        status = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return commit.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def build_commit() -> str:
    """The commit this installation comes from: the checkout's own for an editable install, the one recorded at
    build time for a wheel built from a checkout, else ""."""
    tree = editable_checkout()
    if tree is not None:
        return git_commit(tree)
    try:
        return (resources.files("picker") / BUILD_COMMIT_FILE).read_text().strip()
    except OSError:
        return ""


def install_hint(extra: str) -> str:
    """The command that installs an extra of the picker: `pip install 'llm-picker[tokenizer]'`."""
    return f"pip install '{DIST_NAME}[{extra}]'"


def lab_install_hint(extra: str = "") -> str:
    """The command that installs the lab (with an extra) from a checkout: `make install` does the same."""
    return "pip install -e lab" if not extra else f"pip install -e 'lab[{extra}]'"


def version_line() -> str:
    """`picker --version`: "llm-picker 0.1.0 (commit 0123abcd4567)", the commit only when known."""
    commit = build_commit()
    return f"{DIST_NAME} {picker.__version__}" + (f" (commit {commit})" if commit else "")
