"""A rolling restart of the picker's replicas behind one real Envoy, as a Deployment rolls them: a stopping replica
reports NOT_SERVING and keeps taking streams until Envoy's health check has moved away, so no request takes the
fail-open route (where it would lose its prefix affinity) and none fails."""

from __future__ import annotations

import asyncio
import functools
import json
import time

import aiohttp

from picker_lab.supervisor import port_open, process_scope, start_backends, start_picker_fleet
from tests.waiting import eventually

CHAT = "/v1/chat/completions"


async def steady_load(url: str, stop: asyncio.Event, rows: list[tuple[int, bool]]) -> None:
    """One request after another: (status, whether it took the fail-open route)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        i = 0
        while not stop.is_set():
            body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": f"conversation {i % 7}"}]})
            i += 1
            try:
                async with session.post(url + CHAT, data=body, headers={"content-type": "application/json"}) as resp:
                    await resp.read()
                    rows.append((resp.status, "x-picker-fail-open" in resp.headers))
            except aiohttp.ClientError:
                rows.append((-1, False))
            await asyncio.sleep(0.01)


def test_fail_open_is_seen_without_a_shutdown_delay() -> None:
    """The check below can fail: with no shutdown delay, streams Envoy still sends to the stopping replica are
    refused and take the fail-open route."""
    assert rolled(["--shutdown-delay", "0"]) > 0


def test_a_rolling_restart_sends_nothing_to_the_fail_open_route() -> None:
    assert rolled([]) == 0


def rolled(flags: list[str]) -> int:
    """Restart each of two replicas in turn under steady load; returns how many requests failed open (none
    may fail otherwise)."""
    with process_scope("rolling-restart") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        fleet = start_picker_fleet(logdir, backends.addresses, flags=["--log-level", "WARNING", *flags], replicas=2,
                                   name="rolling")
        started.extend(fleet.processes)

        async def run() -> list[tuple[int, bool]]:
            rows: list[tuple[int, bool]] = []
            stop = asyncio.Event()
            tasks = [asyncio.create_task(steady_load(fleet.envoy.url, stop, rows)) for _ in range(4)]
            await eventually(lambda: len(rows) > 40, 10.0, "requests served before the restarts")
            for picker in fleet.pickers:
                await asyncio.to_thread(picker.process.restart)
                ready = functools.partial(port_open, picker.grpc_port, picker.host)
                await eventually(ready, 20.0, f"{picker.process.name} back")
                await eventually(functools.partial(lambda served: len(rows) > served + 40, len(rows)), 10.0,
                                 "requests served after the restart")
            stop.set()
            await asyncio.gather(*tasks)
            return rows

        began = time.monotonic()
        rows = asyncio.run(run())
        assert all(status == 200 for status, _ in rows), [r for r in rows if r[0] != 200][:5]
        assert time.monotonic() - began < 40
        return sum(failed_open for _, failed_open in rows)
