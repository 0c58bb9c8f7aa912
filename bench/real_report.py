"""Re-render a `make bench-real` run's report (real.md and real-ttft.png) from its real.json with today's report
code: new sections (cold causes, where the TTFT goes) for a run already made, without another hour of vLLM.
`--sim` also re-runs the simulator's mirror of the run (fast mode, seconds) at the run's measured machine speed
and writes it back into real.json.

    python bench/real_report.py [--sim] [bench/out/real]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from picker.bench.real import RealSpec, mirror, plot, report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="real_report.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="bench/out/real", help="the run's directory (holds real.json)")
    parser.add_argument("--sim", action="store_true", help="re-run the simulator's mirror at the run's speed")
    args = parser.parse_args(argv)
    out = Path(args.out)
    source = out / "real.json"
    if not source.is_file():
        print(f"real_report: no {source} (run `make bench-real` first)", file=sys.stderr)
        return 2
    section = json.loads(source.read_text())
    if args.sim:
        mirror(section, RealSpec.recorded(section["spec"]))
        source.write_text(json.dumps(section, indent=1, default=str))
    text = report(section)
    (out / "real.md").write_text(text)
    plot(section, out / "real-ttft.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
