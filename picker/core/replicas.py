"""This replica's place among the picker replicas that share a pool (through Redis or Valkey).

Replicas sharing a pool hold nearly the same view: the same scraped metrics (one replica scrapes each pod for
all), the same prefix index and each other's picks within milliseconds. Plugins that break ties the same way on
the same view then send concurrent requests of different replicas to the same pod; knowing its index among the
live replicas lets a plugin make replica i of n take the i-th best choice instead. The shared load keeps it
current (every replica reports there each sync); without sharing, a replica is 0 of 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class ReplicaPosition:
    """Index of this replica among the `count` live ones (ordered by replica id, so each agrees on its own)."""

    index: int = 0
    count: int = 1

    def update(self, own: str, others: Iterable[str]) -> None:
        ids = sorted({own, *others})
        self.index, self.count = ids.index(own), len(ids)
