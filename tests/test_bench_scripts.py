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
    """target -> its recipe lines, from the Makefile; a rule over `$(VAR)` gives each target of the variable its own
    recipe, `$@` and `$(subst -,_,$@)` filled in, as make runs it."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    variables = {m.group(1): m.group(2).split() for m in re.finditer(r"^([A-Z_]+) :?= (.*)$", text, re.M)}
    out: dict[str, str] = {}
    targets: list[str] = []
    for line in text.splitlines():
        head = re.match(r"^([a-z][a-z0-9-]*|\$\(([A-Z_]+)\)):", line)
        if head:
            targets = variables.get(head.group(2), []) if head.group(2) else [head.group(1)]
            for target in targets:
                out[target] = ""
        elif line.startswith("\t"):
            for target in targets:
                out[target] += line.replace("$(subst -,_,$@)", target.replace("-", "_")).replace("$@", target) + "\n"
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
