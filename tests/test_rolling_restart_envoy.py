"""A rolling restart of the picker's replicas behind one real Envoy, as a Deployment rolls them: a stopping replica
reports NOT_SERVING and keeps taking streams until Envoy's health check has read that, so no request takes the
fail-open route (where it would lose its prefix affinity) and none fails, under dense traffic and under sparse
traffic alike (where lulls between streams come while Envoy still routes to the stopping replica)."""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import time

import aiohttp

from picker_lab.supervisor import port_open, process_scope, start_backends, start_picker_fleet
from tests.waiting import eventually

CHAT = "/v1/chat/completions"


async def steady_load(url: str, stop: asyncio.Event, rows: list[tuple[int, bool]], pause: float) -> None:
    """One request after another, `pause` seconds apart: (status, whether it took the fail-open route)."""
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
            await asyncio.sleep(pause)


def test_fail_open_is_seen_without_a_shutdown_delay() -> None:
    """The check below can fail: with no shutdown delay, streams Envoy still sends to the stopping replica are
    refused and take the fail-open route."""
    assert rolled(["--shutdown-delay", "0"]) > 0


def test_a_rolling_restart_sends_nothing_to_the_fail_open_route() -> None:
    assert rolled([]) == 0


def test_lulls_in_sparse_traffic_do_not_end_the_wait_for_the_health_check() -> None:
    """One request every 0.4 s: each replica sees gaps longer than the quiet a stopping replica waits for, so a
    replica that stopped on the first lull would refuse what Envoy sends it before its next health check."""
    assert rolled([], clients=1, pause=0.4, served_between=6) == 0


def test_sigint_stops_a_picker_behind_envoy_at_once() -> None:
    """Ctrl-C is a person's stop, not an orchestrator's: no wait for Envoy's next health check."""
    with process_scope("sigint") as (logdir, started):
        backends = start_backends(1, logdir)
        started.append(backends.process)
        fleet = start_picker_fleet(logdir, backends.addresses, replicas=1, name="sigint")
        started.extend(fleet.processes)
        picker = fleet.pickers[0]
        began = time.monotonic()
        picker.process.proc.send_signal(signal.SIGINT)
        assert picker.process.proc.wait(10) == 0, picker.process.log_tail()
        assert time.monotonic() - began < 1.5  # Envoy checks every 2 s: a wait for it would take longer


def rolled(flags: list[str], clients: int = 4, pause: float = 0.01, served_between: int = 40) -> int:
    """Restart each of two replicas in turn under steady load (`clients` loops, `pause` s between a loop's
    requests); returns how many requests failed open (none may fail otherwise)."""
    with process_scope("rolling-restart") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        fleet = start_picker_fleet(logdir, backends.addresses, flags=["--log-level", "WARNING", *flags], replicas=2,
                                   name="rolling")
        started.extend(fleet.processes)

        async def run() -> list[tuple[int, bool]]:
            rows: list[tuple[int, bool]] = []
            stop = asyncio.Event()
            tasks = [asyncio.create_task(steady_load(fleet.envoy.url, stop, rows, pause)) for _ in range(clients)]
            await eventually(lambda: len(rows) > served_between, 10.0, "requests served before the restarts")
            for picker in fleet.pickers:
                await asyncio.to_thread(picker.process.restart)
                ready = functools.partial(port_open, picker.grpc_port, picker.host)
                await eventually(ready, 20.0, f"{picker.process.name} back")
                await eventually(functools.partial(lambda served: len(rows) > served + served_between, len(rows)),
                                 10.0, "requests served after the restart")
            stop.set()
            await asyncio.gather(*tasks)
            return rows

        began = time.monotonic()
        rows = asyncio.run(run())
        assert all(status == 200 for status, _ in rows), [r for r in rows if r[0] != 200][:5]
        assert time.monotonic() - began < 40
        return sum(failed_open for _, failed_open in rows)
