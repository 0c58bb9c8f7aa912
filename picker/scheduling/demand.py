"""How much recent traffic wants each prefix: picks per prefix, fading with time, and all picks beside them.

A prefix is counted at the depth the pods hold it, rounded down to DEMAND_DEPTH blocks: requests that share a
system prompt part inside the block where it ends, and some match a block further by chance (a common first
word); counting at the exact depth would split one prefix's demand over many keys. Prefixes shorter than that are
not counted (a chat turn's own prompt is nobody else's prefix). Kept from this replica's own picks: N replicas
each see about 1/N of the counts, and the same shares.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from picker.scheduling.context import SchedulingContext

DEMAND_DEPTH = 8
DEMAND_KEYS = 4096  # prefixes whose demand is remembered (least recently picked forgotten first)


class PrefixDemand:
    """Picks per prefix key and of all requests, each pick fading with time constant `window_seconds`."""

    def __init__(self, window_seconds: float, keys: int = DEMAND_KEYS) -> None:
        if window_seconds <= 0 or keys < 1:
            raise ValueError("a demand window must be positive and keep at least one key")
        self.window_seconds = window_seconds
        self.keys = keys
        self._picks: OrderedDict[int, list[float]] = OrderedDict()  # prefix key -> [picks, decayed to when]
        self._all = [0.0, 0.0]  # every pick, prefixes counted or not: [picks, decayed to when]

    @staticmethod
    def depth(ctx: SchedulingContext, best: int) -> int:
        """The depth, in blocks, at which a prefix matched `best` blocks deep is counted; 0: not counted."""
        depth = best - best % DEMAND_DEPTH
        return depth if len(ctx.keys) >= depth else 0

    def _faded(self, entry: list[float], now: float) -> float:
        return entry[0] * math.exp(-(now - entry[1]) / self.window_seconds) if entry[0] else 0.0

    def of(self, key: int, now: float) -> float:
        """Recent picks of the prefix `key`."""
        entry = self._picks.get(key)
        return 0.0 if entry is None else self._faded(entry, now)

    def total(self, now: float) -> float:
        """Recent picks of every request."""
        return self._faded(self._all, now)

    def note(self, ctx: SchedulingContext, now: float) -> None:
        """Count a pick: for the longest prefix it shares with what the pods hold, and among all picks."""
        self._all[0] = self._faded(self._all, now) + 1.0
        self._all[1] = now
        if not ctx.matches:
            return
        depth = self.depth(ctx, max(ctx.matches.values()))
        if not depth:
            return
        key = ctx.keys[depth - 1]
        entry = self._picks.get(key)
        if entry is None:
            self._picks[key] = [1.0, now]
            if len(self._picks) > self.keys:
                self._picks.popitem(last=False)
            return
        entry[0] = self._faded(entry, now) + 1.0
        entry[1] = now
        self._picks.move_to_end(key)
