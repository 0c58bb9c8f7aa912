"""The ready pods' own in-flight counts and last pick times as numpy columns, kept as requests start and finish.

A decision in a large pool scores only a sample of it (picker.scheduling.filters, candidate-sample-filter), and the
sample's core is the least loaded pods and those picked longest ago: reading every pod's counts in Python to find them
was most of a decision at 4,000 pods. The pool keeps one set of columns over its ready list (the list the director's
candidates are, unfiltered); each of its pods writes its row when it changes, so finding them is one vectorised pass.
A pod belongs to one pool: the pool that tracked it last is the one its row is in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from picker.endpoints.state import Endpoint


class LoadColumn:
    """`requests[i]` and `tokens[i]`: what we have in flight on `endpoints[i]` (its `in_flight`, `in_flight_tokens`);
    `picked_at[i]`: when we last sent it a request (its `last_picked_at`, -1: never)."""

    __slots__ = ("endpoints", "requests", "tokens", "picked_at")

    def __init__(self) -> None:
        self.endpoints: list[Endpoint] = []
        self.requests = np.zeros(0, dtype=np.float64)
        self.tokens = np.zeros(0, dtype=np.float64)
        self.picked_at = np.zeros(0, dtype=np.float64)

    def track(self, endpoints: list[Endpoint]) -> None:
        """Follow `endpoints` (the pool's new ready list, kept by identity) instead of the list before it."""
        for e in self.endpoints:
            if e.column is self:
                e.column = None
        self.endpoints = endpoints
        self.requests = np.array([e.in_flight for e in endpoints], dtype=np.float64)
        self.tokens = np.array([e.in_flight_tokens for e in endpoints], dtype=np.float64)
        self.picked_at = np.array([e.last_picked_at for e in endpoints], dtype=np.float64)
        for i, e in enumerate(endpoints):
            e.column, e.row = self, i

    def covers(self, candidates: list[Endpoint]) -> bool:
        """Whether the rows are `candidates`, in their order (the pool's ready list itself, not a subset of it)."""
        return candidates is self.endpoints

    def update(self, endpoint: Endpoint) -> None:
        self.requests[endpoint.row] = endpoint.in_flight
        self.tokens[endpoint.row] = endpoint.in_flight_tokens
        self.picked_at[endpoint.row] = endpoint.last_picked_at
