"""The cold-prompt deal (`cold-prefix-spreader`): a prompt no pod holds is dealt to the pod least recently handed
uncached work, weighed by the prefill it was dealt lately, so cold prompts do not pile onto one pod between scrapes.
A prompt whose opening has a home goes back there; one most of which some pod holds is left to the prefix scorer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from picker.core.replicas import ReplicaView
from picker.core.schema import Section
from picker.endpoints.state import Endpoint
from picker.scheduling.context import SchedulingContext
from picker.scheduling.memory import FadingTally
from picker.scheduling.plugins import (
    PeerPick,
    Plugin,
    PluginDeps,
    PluginFactory,
    default_of,
    min_max_inverse,
)


@dataclass(slots=True)
class DealtWork:
    """For Explain: the uncached prompt tokens the deal still counts against a candidate (decayed)."""

    tokens: float

    def explain(self) -> dict[str, float]:
        return {"work_tokens": self.tokens}


class ColdPrefixSpreader(Plugin):
    """A prompt nobody has cached goes to the least recently chosen, least loaded pod; one whose opening has a
    home (it was sent before and every pod has since evicted it) goes home.

    Without it, cold requests that arrive between two metric scrapes see identical scores and pile up on
    whatever the tie-break favours; with it they deal out like cards. Neutral (all 0) when some candidates hold
    more of the prompt than others and one holds at least `standAsideShare` of it, so it never fights prefix
    affinity, and when the request's session has a pod among the candidates, so it never fights session
    affinity. A prompt whose opening every candidate holds alike (a system prompt all prompts share), or which
    is mostly cold wherever it goes (a short opening some pods hold before a long new question), is dealt
    (docs/decisions.md). A prefix coming back is not dealt: on another pod it would join that pod's
    working set and evict one of its prefixes (docs/decisions.md); the load scorers still weigh against a
    busy home.

    The deal mixes recency (`recencyWeight`) with load: our in-flight count on the pod (or its scraped queue when
    longer: docs/decisions.md) plus, with `workTokens` > 0, the uncached prompt tokens it was dealt lately
    (fading with `workHalfLife`, and never more than its requests still in flight carry), `workTokens` of them
    weighing as one request in flight. A pod still prefilling a long cold prompt is skipped even when its turn has
    come; a short or cached prompt barely counts, a pod that has answered its requests not at all (docs/decisions.md,
    21). Replicas sharing a pool each deal their own share of the pods first (`_own_share_first`).
    """

    type_name = "cold-prefix-spreader"
    needs_prefix = True

    def __init__(self, name: str | None = None, *, recency_weight: float = 0.25, work_tokens: float = 128.0,
                 work_half_life: float = 0.2, home_credit: float = 0.5,
                 stand_aside_share: float = 0.3, replicas: ReplicaView | None = None) -> None:
        super().__init__(name)
        self.replicas = replicas
        if not 0.0 <= recency_weight <= 1.0 or not 0.0 <= home_credit <= 1.0 or not 0.0 <= stand_aside_share <= 1.0:
            raise ValueError("recencyWeight, homeCredit and standAsideShare must be within [0, 1]")
        if work_tokens < 0 or work_half_life <= 0:
            raise ValueError("workTokens must be >= 0 and workHalfLife positive")
        self.recency_weight = recency_weight
        self.work_tokens = work_tokens
        self.home_credit = home_credit
        self.stand_aside_share = stand_aside_share
        self._seq = 0
        self._last_pick: dict[str, int] = {}
        self._work = FadingTally(work_half_life)  # uncached prompt tokens dealt to each pod lately
        # each of the candidates the replicas' shares were last cut from: its place in their address order
        self._place: dict[str, int] = {}

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        matched = ctx.matched
        held = max(matched, default=0)
        session_pod = ctx.session_pod
        if (held and min(matched) != held and ctx.covers(held, self.stand_aside_share)) or (
                session_pod is not None and any(e.address == session_pod for e in candidates)):
            return [0.0] * len(candidates)
        home = ctx.home
        # a home not among the candidates (gone, filtered out): deal as usual
        if home is not None and not held and any(e.address == home for e in candidates):
            return [self.home_credit if e.address == home else 0.0 for e in candidates]
        get = self._last_pick.get
        recency = min_max_inverse([get(e.address, -1) for e in candidates])
        # what the pod has in hand: our requests in flight, or its queue at the last scrape when longer (other
        # replicas' requests, or requests our counts do not see); its running count would add the decoding ones
        loads = [float(max(e.in_flight, e.metrics.waiting)) for e in candidates]
        if self.work_tokens and self._work:
            # FadingTally.value inlined, as in InFlightLoadScorer.score
            entries, half, unit, now = self._work.entries.get, self._work.half_life, self.work_tokens, ctx.now
            dealt = [DealtWork(0.0) for _ in candidates]
            for i, e in enumerate(candidates):
                entry = entries(e.address)
                if entry is not None:
                    left = entry[0] * 0.5 ** ((now - entry[1]) / half)
                    # no more than its requests still in flight carry: a pod that has answered them is done
                    carried = e.in_flight_tokens + e.peer_in_flight_tokens
                    dealt[i].tokens = left if left < carried else float(carried)
                    loads[i] += dealt[i].tokens / unit
            ctx.note(self.name, dealt)
        lo = min(loads)
        span = max(loads) - lo + 1
        w = self.recency_weight
        scores = [w * r + (1.0 - w) * (1.0 - (f - lo) / span) for r, f in zip(recency, loads, strict=True)]
        replicas = self.replicas
        if replicas is not None and replicas.count > 1 and len(candidates) >= 2 * replicas.count:
            return self._own_share_first(scores, candidates, replicas.index, replicas.count)
        return scores

    def _own_share_first(self, scores: list[float], candidates: Sequence[Endpoint], index: int,
                         count: int) -> list[float]:
        """Replicas sharing a pool see nearly the same pods (shared scrapes, each other's picks within
        milliseconds), so each dealing its best pod would send cold prompts that reach different replicas within
        those milliseconds to the same one. Replica `index` of `count` deals its own share of the candidates
        first: the pods whose place in their address order is `index` modulo `count` score in [0.5, 1], the others
        in [0, 0.5], each by its deal score within. Every replica agrees on the shares whatever it has heard yet,
        so two replicas dealing at once do not meet on one pod through the deal (the load scorers still weigh: a
        busy share sends a prompt to another's idle pod)."""
        place = self._place
        if len(place) != len(candidates) or any(e.address not in place for e in candidates):
            # another set of candidates (pods came or went, another model's pool): their order anew
            self._place = place = {a: i for i, a in enumerate(sorted(e.address for e in candidates))}
        return [0.5 + 0.5 * x if place[e.address] % count == index else 0.5 * x
                for x, e in zip(scores, candidates, strict=True)]

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        self._note(endpoint.address)
        if self.work_tokens:
            self._work.add(endpoint.address, ctx.uncached_tokens(endpoint.address), now)

    def on_peer_picked(self, pick: PeerPick, now: float) -> None:
        self._note(pick.address)
        if self.work_tokens:  # a peer's pick carries its prompt, not what the pod had cached of it
            self._work.add(pick.address, pick.prompt_tokens, now)

    def _note(self, address: str) -> None:
        self._seq += 1
        self._last_pick[address] = self._seq

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        self._last_pick.pop(endpoint.address, None)
        self._work.forget(endpoint.address)


# Config factories: each decodes its own parameters (camelCase in YAML) and takes what it needs from the deps.

class ColdPrefixSpreaderParams(Section):
    recency_weight: float = Field(default_of(ColdPrefixSpreader, "recency_weight"), ge=0, le=1)
    work_tokens: float = Field(default_of(ColdPrefixSpreader, "work_tokens"), ge=0)
    work_half_life: float = Field(default_of(ColdPrefixSpreader, "work_half_life"), gt=0)
    home_credit: float = Field(default_of(ColdPrefixSpreader, "home_credit"), ge=0, le=1)
    stand_aside_share: float = Field(default_of(ColdPrefixSpreader, "stand_aside_share"), ge=0, le=1)


def _spreader(name: str, p: ColdPrefixSpreaderParams, deps: PluginDeps) -> Plugin:
    return ColdPrefixSpreader(name, **p.model_dump(), replicas=deps.replicas)


FACTORIES: tuple[PluginFactory[Any], ...] = (
    PluginFactory(ColdPrefixSpreader.type_name, ColdPrefixSpreaderParams, _spreader),
)
