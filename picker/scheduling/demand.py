"""How much recent traffic wants each prefix, and each pod: picks per prefix and per pod, fading with time, and all
picks beside them.

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
    """Picks per prefix key, per pod and of all requests, each pick fading with time constant `window_seconds`."""

    def __init__(self, window_seconds: float, keys: int = DEMAND_KEYS) -> None:
        if window_seconds <= 0 or keys < 1:
            raise ValueError("a demand window must be positive and keep at least one key")
        self.window_seconds = window_seconds
        self.keys = keys
        self._picks: OrderedDict[int, list[float]] = OrderedDict()  # prefix key -> [picks, decayed to when]
        self._all = [0.0, 0.0]  # every pick, prefixes counted or not: [picks, decayed to when]
        self._pods: dict[str, list[float]] = {}  # pod address -> [counted picks, decayed to when]
        self._counted = [0.0, 0.0]  # the picks counted for a prefix, all pods together

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

    def counted(self, now: float) -> float:
        """Recent picks counted for a prefix (those `of_pod` counts, all pods together)."""
        return self._faded(self._counted, now)

    def of_pod(self, address: str, now: float) -> float:
        """Recent picks counted for a prefix that went to the pod at `address`."""
        entry = self._pods.get(address)
        return 0.0 if entry is None else self._faded(entry, now)

    def forget_pod(self, address: str) -> None:
        self._pods.pop(address, None)

    def copied(self, key: int, holders: list[str], to: str, now: float) -> None:
        """The prefix `key` is being copied from `holders` to `to`: from now on its traffic is shared by one more
        holder, so that pod's part of the prefix's recent picks moves to it at once (the pods' shares would
        otherwise show the move only as fast as the picks fade, and every prefix of a crowded pod would be
        copied before its share came down)."""
        amount = self.of(key, now) / (len(holders) + 1)
        if amount <= 0.0 or not holders:
            return
        for address in holders:
            entry = self._pods.get(address)
            if entry is not None:
                entry[0] = max(0.0, self._faded(entry, now) - amount / len(holders))
                entry[1] = now
        entry = self._pods.setdefault(to, [0.0, now])
        entry[0] = self._faded(entry, now) + amount
        entry[1] = now

    def note(self, ctx: SchedulingContext, now: float, address: str | None = None) -> None:
        """Count a pick: among all picks, and, when it shares a prefix with what the pods hold, for its longest such
        prefix and for the pod it went to (when given)."""
        self._all[0] = self._faded(self._all, now) + 1.0
        self._all[1] = now
        if not ctx.matches:
            return
        depth = self.depth(ctx, max(ctx.matches.values()))
        if not depth:
            return
        if address is not None:
            self._counted[0] = self._faded(self._counted, now) + 1.0
            self._counted[1] = now
            pod = self._pods.get(address)
            if pod is None:
                self._pods[address] = [1.0, now]
            else:
                pod[0] = self._faded(pod, now) + 1.0
                pod[1] = now
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
