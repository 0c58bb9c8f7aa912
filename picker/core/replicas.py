"""This replica among the picker replicas that share a pool (through Redis or Valkey): its place among the live
ones, and what they have learned of the traffic.

Replicas sharing a pool hold nearly the same view: the same scraped metrics (one replica scrapes each pod for
all), the same prefix index and each other's picks within milliseconds. Plugins that break ties the same way on
the same view then send concurrent requests of different replicas to the same pod; knowing its index among the
live replicas lets a plugin make replica i of n take its own share of the choices first instead. The shared load
keeps it current (every replica reports there each sync); without sharing, a replica is 0 of 1.

What a replica learns from the pods over minutes (the traffic's characters per token, which sizes each pod's share
of the prefix index) a replica that has just started does not know: it reads the others' figure from their
reports until it has a sample of its own, instead of routing its first minute on the configured guess.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class ReplicaView:
    """Index of this replica among the `count` live ones (ordered by replica id, so each agrees on its own); the
    characters per token this replica has learned (`chars_per_token`, None: no sample yet), which it reports, and
    the live others' (`peers_chars_per_token`: the median of their reports, None: none reports one)."""

    index: int = 0
    count: int = 1
    chars_per_token: float | None = None
    peers_chars_per_token: float | None = None

    def update(self, own: str, others: Iterable[str]) -> None:
        ids = sorted({own, *others})
        self.index, self.count = ids.index(own), len(ids)

    def heard(self, learned: list[float]) -> None:
        """The characters per token the live other replicas reported in the last sync (those that learned one)."""
        self.peers_chars_per_token = statistics.median(learned) if learned else None
