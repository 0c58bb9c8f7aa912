"""A pod leaving the pool and a fresh one joining during a real-engine run, as a rolling restart does it.

The change is published to the router under test the way it learns its pool: the pickers and hash baselines follow
an endpoints file (`picker serve --endpoints-file`, polled every second; `write_pool`), the way a picker follows an
InferencePool's EndpointSlices; the peer routers get their own add/remove-worker API calls (peers.PeerPool), as
their service discovery makes them. At `leave_s` the leaving server is taken out of the pool, so no new request
goes to it; it keeps the requests it has until they finish (at most `drain_s`, Kubernetes' default
termination grace period) and is then stopped. At `rejoin_s` a server started before the run (so its start-up does
not share the cores with the measurement) enters the pool: a new address with an empty cache, which is what a
restarted pod is.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from picker_lab.bench.live import read_counters

# Kubernetes' default terminationGracePeriodSeconds: how long a leaving pod may finish what it holds.
DRAIN_S = 30.0
# The picker reloads its endpoints file every second: a request it routed just before the change may still be on
# its way to the leaving server for that long, so the drain check starts after two reloads (a peer's own API acts
# at once; the same wait for it).
RELOAD_S = 2.0


class Member(Protocol):
    """A model server the pool change moves: a vLLM server in the benchmark, an echo pod in the tests."""

    @property
    def address(self) -> str: ...

    @property
    def url(self) -> str: ...

    def stop(self) -> None: ...


def write_pool(path: Path, addresses: list[str]) -> None:
    """Replace the endpoints file in one step (a reader never sees half of it)."""
    part = path.with_name(path.name + ".part")
    part.write_text("".join(f"- {a}\n" for a in addresses))
    os.replace(part, path)


def _busy(url: str) -> bool:
    counters = read_counters(url)
    return counters["running"] + counters["waiting"] > 0


@dataclass
class PoolChange:
    """One leave and one join during a run; `run` is the body of a thread started with the trace. `publish` tells
    the router the pool's addresses (the router starts with `staying` and `leaving`). `last_words` reads what the
    run's totals need of the leaving server just before it stops (kept in `last`)."""

    publish: Callable[[list[str]], None]
    staying: list[Member]
    leaving: Member
    joining: Member
    leave_s: float
    rejoin_s: float
    last_words: Callable[[], Any]
    drain_s: float = DRAIN_S
    events: list[tuple[str, float]] = field(default_factory=list)  # (what, seconds into the run)
    last: Any = None

    def run(self, began: float, cancel: threading.Event) -> None:
        """Leave at `leave_s`, join at `rejoin_s` (seconds after `began`), unless cancelled first."""
        if cancel.wait(max(0.0, began + self.leave_s - time.monotonic())):
            return
        self.leave(began, cancel)
        if cancel.wait(max(0.0, began + self.rejoin_s - time.monotonic())):
            return
        self.join(began)

    def leave(self, began: float, cancel: threading.Event) -> None:
        """Out of the pool; then the server finishes what it holds and stops."""
        self.publish([s.address for s in self.staying])
        self.events.append(("left", time.monotonic() - began))
        deadline = time.monotonic() + self.drain_s
        cancel.wait(RELOAD_S)
        while time.monotonic() < deadline and _busy(self.leaving.url) and not cancel.wait(0.5):
            pass
        self.last = self.last_words()
        self.leaving.stop()
        self.events.append(("stopped", time.monotonic() - began))

    def join(self, began: float) -> None:
        """The fresh server into the pool."""
        self.publish([s.address for s in [*self.staying, self.joining]])
        self.events.append(("joined", time.monotonic() - began))
