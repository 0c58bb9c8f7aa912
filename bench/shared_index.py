"""How fast replicas of the shared prefix index converge, and what sharing costs per pick.

Two `SharedPrefixIndex` replicas on one local Valkey: replica A records picks (64-block chains, the size of a
~16 KB prompt at 64-character blocks), replica B follows. Reports the replication lag (A's `record` → B matches
the chain) at a steady pick rate, and the CPU per pick spent publishing (A) and applying (B).

    .venv/bin/python bench/shared_index.py [--picks 2000] [--rate 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from picker.prefix.memory import InMemoryPrefixIndex  # noqa: E402
from picker.prefix.shared import SharedPrefixIndex  # noqa: E402
from picker_lab.supervisor import process_scope, start_valkey  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


async def measure(url: str, picks: int, rate: float, blocks: int) -> dict[str, float]:
    rng = random.Random(1)
    a = SharedPrefixIndex(InMemoryPrefixIndex(), url, "bench")
    b = SharedPrefixIndex(InMemoryPrefixIndex(), url, "bench")
    await a.start()
    await b.start()
    try:
        pods = [f"10.0.0.{i}:8000" for i in range(1, 9)]
        sent: dict[int, float] = {}
        lags: list[float] = []
        pending: dict[int, tuple[list[int], str]] = {}

        async def watch() -> None:
            # Entries arrive in order: only the oldest pending pick needs checking.
            while len(lags) < picks:
                now = time.monotonic()
                while pending:
                    i = next(iter(pending))
                    keys, pod = pending[i]
                    if b.local.match(keys, (pod,), now).get(pod) != len(keys):
                        break
                    lags.append(time.perf_counter() - sent[i])
                    del pending[i]
                await asyncio.sleep(0.0005)

        watcher = asyncio.create_task(watch())
        cpu0 = time.process_time()
        began = time.perf_counter()
        for i in range(picks):
            keys = [rng.getrandbits(64) for _ in range(blocks)]
            pod = rng.choice(pods)
            sent[i] = time.perf_counter()
            pending[i] = (keys, pod)
            a.record(keys, pod, time.monotonic())
            await asyncio.sleep(max(0.0, began + (i + 1) / rate - time.perf_counter()))
        await asyncio.wait_for(watcher, 30)
        cpu = time.process_time() - cpu0
    finally:
        await a.stop()
        await b.stop()
    lags.sort()
    return {"picks": picks, "rate_per_s": rate, "blocks_per_pick": blocks,
            "lag_p50_ms": round(lags[len(lags) // 2] * 1e3, 2),
            "lag_p99_ms": round(lags[int(len(lags) * 0.99)] * 1e3, 2),
            "lag_mean_ms": round(statistics.fmean(lags) * 1e3, 2),
            # Both replicas run in this process: publish + apply + the watcher's polling, per pick.
            "cpu_us_per_pick_both_replicas": round(cpu / picks * 1e6)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--picks", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--blocks", type=int, default=64)
    args = parser.parse_args()
    with process_scope("bench-shared-index") as (logdir, started):
        valkey = start_valkey(logdir)
        started.append(valkey.process)
        result = asyncio.run(measure(valkey.url, args.picks, args.rate, args.blocks))
    print(json.dumps(result, indent=2))
    OUT.mkdir(exist_ok=True)
    (OUT / "shared_index.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
