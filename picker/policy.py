"""Builds the policy objects `picker serve` runs with (scheduler, admission, metrics scraper) from config.

Kept apart from the server so the benchmark builds exactly the same policy without starting servers.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

from picker.config import ServeConfig
from picker.director import Admission
from picker.endpoints.pool import EndpointPool
from picker.endpoints.state import Endpoint
from picker.observability import PickerMetrics
from picker.requests import InferenceRequest
from picker.scheduling.types import CandidateScore, Scheduler, SchedulingResult


class LeastInFlightScheduler:
    """Fewest of our own in-flight requests, random tie-break: the interim policy until scoring lands."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def schedule(self, request: InferenceRequest, endpoints: Sequence[Endpoint], now: float) -> SchedulingResult:
        order = sorted(endpoints, key=lambda e: (e.in_flight, self.rng.random()))
        top = order[0].in_flight if order else 0
        candidates = [CandidateScore(e, {"in-flight": 1.0 / (1 + e.in_flight - top)}) for e in order]
        for c in candidates:
            c.total = c.scores["in-flight"]
        return SchedulingResult(ranked=order, profile="least-in-flight", candidates=candidates)

    def on_picked(self, request: InferenceRequest, endpoint: Endpoint, now: float) -> None:
        return None

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        return None


def build_scheduler(config: ServeConfig) -> Scheduler:
    rng = random.Random(config.seed)
    return LeastInFlightScheduler(rng)


def build_admission(config: ServeConfig) -> Admission | None:
    return None


def start_scraper(config: ServeConfig, pool: EndpointPool, metrics: PickerMetrics) -> asyncio.Task[None] | None:
    return None
