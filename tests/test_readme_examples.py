"""The README's `picker explain` example works as written against `picker sim` (one default model everywhere)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from picker_lab.supervisor import process_scope, start_picker, start_sim

ROOT = Path(__file__).resolve().parent.parent


def readme_command(prefix: str) -> list[str]:
    """The arguments (after `picker COMMAND`) of the README's first command line starting with `prefix`, its
    trailing comment dropped."""
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(prefix))
    return shlex.split(line, comments=True)[2:]


def test_the_readme_explain_example_gets_a_pick_from_a_picker_in_front_of_picker_sim() -> None:
    args = readme_command("picker explain --body")
    with process_scope("readme-explain") as (logdir, started):
        sim = start_sim(2, logdir, time_scale=10.0)
        started.append(sim.process)
        picker = start_picker(logdir, endpoints=sim.addresses)
        started.append(picker.process)
        result = subprocess.run([sys.executable, "-m", "picker", "explain", "--target", picker.target, "--plaintext",
                                 *args], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pick: " in result.stdout and "refused" not in result.stdout, result.stdout
