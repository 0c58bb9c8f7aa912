"""Slow uploads against the body cap: many request bodies through Envoy that never finish.

The picker must refuse every upload past `--max-buffered-bytes` (503 `buffers_full`) and its memory must not grow
with the number refused. One run: `count` uploads of `body_bytes` each (chunked, 1 MiB at a time, then nothing),
until the picker has refused all it cannot hold; the picker's RSS sampled throughout. Shared by the test that
guards it (`tests/test_stream_limits.py`) and the benchmark that measures it (`bench/upload_memory.py`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from picker_lab.supervisor import Managed

MIB = 2**20
REFUSED = ("inference_objective_request_error_total", "buffers_full")
HELD = ("picker_buffered_request_bytes", "")


async def picker_samples(metrics_url: str) -> dict[tuple[str, str], float]:
    """(series name, its error_code/reason label) -> value, summed over the other labels."""
    async with aiohttp.ClientSession() as session, session.get(metrics_url) as response:
        text = await response.text()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, s.labels.get("error_code") or s.labels.get("reason") or "")
            out[key] = out.get(key, 0.0) + s.value
    return out


@dataclass
class UploadRun:
    count: int
    admitted: int  # uploads the cap can hold whole
    rss_before: int
    rss_peak: int = 0
    rss_after: int = 0
    refused: int = 0  # buffers_full refusals the picker counted
    statuses: list[int] = field(default_factory=list)  # what the refused clients got
    held_max: float = 0.0  # the most body bytes the picker reported holding
    seconds: float = 0.0
    complete: bool = False  # every upload past the cap was refused and answered within the time given

    def summary(self) -> dict[str, object]:
        return {"uploads": self.count, "admitted": self.admitted, "refused": self.refused,
                "statuses": sorted(set(self.statuses)), "answered": len(self.statuses),
                "held_max_mib": round(self.held_max / MIB, 1), "rss_before_mib": round(self.rss_before / MIB, 1),
                "rss_peak_mib": round(self.rss_peak / MIB, 1), "rss_after_mib": round(self.rss_after / MIB, 1),
                "rss_growth_mib": round((self.rss_peak - self.rss_before) / MIB, 1),
                "seconds": round(self.seconds, 2), "complete": self.complete}


async def unfinished_uploads(envoy_url: str, metrics_url: str, picker: Managed, *, count: int, body_bytes: int,
                             cap: int, within: float) -> UploadRun:
    """Start `count` unfinished uploads; return once all past the cap are refused and answered (or `within`
    seconds passed), after cancelling every upload."""
    run = UploadRun(count, cap // body_bytes, picker.rss_bytes())
    run.rss_peak = run.rss_before
    refused_before = (await picker_samples(metrics_url)).get(REFUSED, 0.0)
    hold = asyncio.Event()
    chunk = b"x" * MIB

    async def unfinished() -> AsyncIterator[bytes]:
        for _ in range(body_bytes // MIB):
            yield chunk
        await hold.wait()

    async def upload(session: aiohttp.ClientSession) -> None:
        async with session.post(envoy_url + "/v1/completions", data=unfinished(),
                                headers={"content-type": "application/json"}) as response:
            await response.read()
            run.statuses.append(response.status)

    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=within + 30)) as session:
        uploads = [asyncio.create_task(upload(session)) for _ in range(count)]
        try:
            while time.monotonic() - started < within:
                run.rss_peak = max(run.rss_peak, picker.rss_bytes())
                values = await picker_samples(metrics_url)
                run.held_max = max(run.held_max, values[HELD])
                run.refused = int(values.get(REFUSED, 0.0) - refused_before)
                if run.refused >= count - run.admitted and len(run.statuses) >= count - run.admitted:
                    run.complete = True
                    break
                await asyncio.sleep(0.02)
        finally:
            run.seconds = time.monotonic() - started
            hold.set()
            for task in uploads:
                task.cancel()
            await asyncio.gather(*uploads, return_exceptions=True)
    run.rss_after = picker.rss_bytes()
    return run
