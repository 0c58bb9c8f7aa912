"""Re-render a `make bench-real` run's report (real.md and real-ttft.png) from its real.json with today's report
code: new sections (cold causes, where the TTFT goes) for a run already made, without another hour of vLLM.
`--sim` also re-runs the simulator's mirror of the run (fast mode, seconds) at the run's measured machine speed
and writes it back into real.json; `--sim-rates R,...` prints (does not store) that mirror replayed at other offered
rates, judged by the run's targets. `--merge DIR...` first writes the directory's real.json from the runs of
several runs of one workload (repeats numbered on in order), `--drop N` leaving out a repeat the machine was
disturbed in (`--why` says how; the report lists its figures apart).

    make real-report OUT=bench/out/real-hot ARGS="--sim"
    python bench/real_report.py [--sim [--seeds N]] [--sim-rates R,...] [--merge DIR... [--drop N] [--why TEXT]] [bench/out/real-uniform]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from picker_lab.bench.real import RealSpec, report_json
from picker_lab.bench.real_figures import combine
from picker_lab.bench.real_mirror import mirror, mirror_at_rates
from picker_lab.bench.real_render import plot, report
from picker_lab.bench.results import read_json, stored_json, write_json_text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="real_report.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="bench/out/real-uniform",
                        help="the run's directory (holds real.json, or real.json.gz as bench/results keeps it)")
    parser.add_argument("--sim", action="store_true", help="re-run the simulator's mirror at the run's speed")
    parser.add_argument("--seeds", type=int, default=3, help="with --sim: traces the mirror averages over")
    parser.add_argument("--sim-rates", type=lambda v: [float(x) for x in v.split(",")], default=[], metavar="R,...",
                        help="print the simulator's mirror at these offered rates (req/s), judged by the run's targets")
    parser.add_argument("--merge", nargs="+", metavar="DIR", help="runs to combine into OUT/real.json")
    parser.add_argument("--drop", type=int, action="append", default=[], metavar="N",
                        help="with --merge: leave out repeat N (1-based, after numbering; repeatable)")
    parser.add_argument("--why", default="", help="with --drop: why those repeats are left out")
    args = parser.parse_args(argv)
    out = Path(args.out)
    source = stored_json(out, "real.json")
    if args.merge:
        sources = [stored_json(Path(d), "real.json") for d in args.merge]
        missing = [str(p) for p in sources if not p.is_file()]
        if missing:
            print(f"real_report: no {', '.join(missing)}", file=sys.stderr)
            return 2
        try:
            merged = combine([read_json(p) for p in sources], tuple(args.drop), args.why)
        except ValueError as exc:
            print(f"real_report: {exc}", file=sys.stderr)
            return 2
        out.mkdir(parents=True, exist_ok=True)
        write_json_text(source, report_json(merged))
    if not source.is_file():
        print(f"real_report: no {source} (run `make bench-real` first)", file=sys.stderr)
        return 2
    section = read_json(source)
    if args.seeds < 1:
        print("real_report: --seeds must be at least 1", file=sys.stderr)
        return 2
    if args.sim:
        mirror(section, RealSpec.recorded(section["spec"]), seeds=args.seeds)
        write_json_text(source, report_json(section))
    text = report(section)
    (out / "real.md").write_text(text)
    plot(section, out / "real-ttft.png")
    print(text)
    if args.sim_rates:
        print("\n".join(["", *mirror_at_rates(section, args.sim_rates, args.seeds)]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
