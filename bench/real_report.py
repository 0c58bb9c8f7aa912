"""Re-render a `make bench-real` run's report (real.md and real-ttft.png) from its real.json with today's report
code: new sections (cold causes, where the TTFT goes) for a run already made, without another hour of vLLM.

    python bench/real_report.py [bench/out/real]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from picker.bench.real import plot, report


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else "bench/out/real")
    source = out / "real.json"
    if not source.is_file():
        print(f"real_report: no {source} (run `make bench-real` first)", file=sys.stderr)
        return 2
    section = json.loads(source.read_text())
    text = report(section)
    (out / "real.md").write_text(text)
    plot(section, out / "real-ttft.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
