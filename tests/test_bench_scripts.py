"""Every script in bench/ is run by a make target and starts: a measurement nobody can rerun, or one that no longer
imports, would leave the figures in the docs without a source."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "bench").glob("*.py"))


def make_recipes() -> dict[str, str]:
    """target -> its recipe lines, from the Makefile."""
    out: dict[str, str] = {}
    target = ""
    for line in (ROOT / "Makefile").read_text().splitlines():
        head = re.match(r"^([a-z][a-z0-9-]*):", line)
        if head:
            target = head.group(1)
            out[target] = ""
        elif line.startswith("\t") and target:
            out[target] += line + "\n"
    return out


def test_every_bench_script_has_a_make_target() -> None:
    recipes = make_recipes()
    orphans = [p.name for p in SCRIPTS if not any(f"bench/{p.name}" in r for r in recipes.values())]
    assert SCRIPTS and not orphans, f"bench scripts no make target runs: {orphans}"


def test_every_bench_script_starts() -> None:
    """`--help` of each, all at once (each imports what its run needs, so a broken import fails here)."""
    procs = {p.name: subprocess.Popen([sys.executable, str(p), "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT) for p in SCRIPTS}
    failed = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        if proc.returncode != 0 or b"usage" not in out.lower():
            failed[name] = out.decode(errors="replace")[-400:]
    assert not failed, failed
