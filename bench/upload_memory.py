"""What unfinished uploads cost the picker: RSS growth while many request bodies through Envoy never finish.

    .venv/bin/python bench/upload_memory.py [--uploads 20,40,80] [--body-mib 15] [--cap-mib 64] [--repeats 3]
    make upload-memory

Each round starts fresh processes (2 echo backends, `picker serve --max-buffered-bytes CAP`, Envoy in
FULL_DUPLEX_STREAMED mode, where bodies reach the picker as clients send them) and runs `picker_lab.bench.uploads`:
N chunked uploads of --body-mib that stop before their end, until the picker has refused every one the cap cannot
hold. Reported per round: refusals and what the clients got, the most body bytes the picker held, its RSS before,
at the peak and after. Rounds are interleaved over N (20, 40, 80, 20, ...) so a noisy machine spreads evenly.
Writes upload-memory.json to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

from picker_lab.bench.uploads import MIB, UploadRun, unfinished_uploads
from picker_lab.supervisor import process_scope, start_backends, start_envoy, start_picker


def one_round(count: int, body_mib: int, cap_mib: int, within: float) -> UploadRun:
    with process_scope("upload-memory") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        picker = start_picker(logdir, endpoints=backends.addresses, extra=[
            "--max-buffered-bytes", f"{cap_mib}Mi", "--stream-idle-timeout", "300s"])
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, backends.addresses, mode="full-duplex")
        started.append(envoy.process)
        return asyncio.run(unfinished_uploads(envoy.url, f"http://127.0.0.1:{picker.metrics_port}/metrics",
                                              picker.process, count=count, body_bytes=body_mib * MIB,
                                              cap=cap_mib * MIB, within=within))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uploads", default="20,40,80", help="comma-separated upload counts")
    parser.add_argument("--body-mib", type=int, default=15)
    parser.add_argument("--cap-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--within", type=float, default=120.0,
                        help="seconds a round waits for every upload past the cap to be refused")
    parser.add_argument("--out", type=Path, default=Path("bench/out/upload-memory"))
    args = parser.parse_args()
    counts = [int(c) for c in args.uploads.split(",")]
    rounds: list[UploadRun] = []
    for repeat in range(args.repeats):
        for count in counts:
            run = one_round(count, args.body_mib, args.cap_mib, args.within)
            print(json.dumps({"repeat": repeat, **run.summary()}), flush=True)
            rounds.append(run)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "upload-memory.json").write_text(json.dumps(
        {"body_mib": args.body_mib, "cap_mib": args.cap_mib, "rounds": [r.summary() for r in rounds]}, indent=1))
    print("\n| uploads | refused (503) per round | other answers | all refused | held max MiB |"
          " RSS growth MiB, median (min-max) | RSS after - before MiB, median |\n|---:|---|---|---|---:|---:|---:|")
    for count in counts:
        mine = [r for r in rounds if r.count == count]
        growth = [(r.rss_peak - r.rss_before) / MIB for r in mine]
        after = [(r.rss_after - r.rss_before) / MIB for r in mine]
        others = sorted({s for r in mine for s in r.statuses if s != 503})
        print(f"| {count} | {', '.join(str(r.refused) for r in mine)} | {others or 'none'} | "
              f"{'yes' if all(r.complete for r in mine) else 'no'} | {max(r.held_max for r in mine) / MIB:.1f} | "
              f"{statistics.median(growth):.0f} ({min(growth):.0f}-{max(growth):.0f}) | {statistics.median(after):.0f} |")

if __name__ == "__main__":
    main()
