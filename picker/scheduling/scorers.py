"""Scorers: each grades every candidate in [0,1] (higher = better) from one signal.

They loop in plain Python: for the pool sizes we serve (< 512 pods) extracting the attributes into numpy
arrays costs as much as the arithmetic it would speed up (bench/decision_cost.py measures it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field

from picker.core.schema import Section
from picker.endpoints.state import Endpoint
from picker.prefix.index import CacheRoom
from picker.scheduling.context import SchedulingContext
from picker.scheduling.demand import PrefixDemand
from picker.scheduling.memory import FadingTally, PodMemory
from picker.scheduling.plugins import (
    NoParams,
    PeerPick,
    Plugin,
    PluginDeps,
    PluginFactory,
    default_of,
    min_max_inverse,
    no_params,
    with_params,
)


class PrefixCacheScorer(Plugin):
    """How much of the prompt the endpoint (probably) has cached.

    matched/total alone lets a 2-block prompt that fully hits outrank real savings, so the score blends the
    ratio with the absolute matched length, saturating at `full_credit_chars`. The load guard zeroes the
    prefix credit of an endpoint loaded well past the least-loaded candidate, so a popular prefix spills to a
    second pod (which then holds it too) instead of queueing on one. "Well past" is both a difference (the
    `load_guard_*` thresholds) and a ratio (`guard_ratio` times the least-loaded one's): when every pod queues, a
    spill only moves the request to another queue and adds a cold prefill to a fleet that has no time for it, and
    under cache pressure evicts another prefix that comes back cold in turn (a real run at the edge of saturation
    copied 23 of 24 prefixes to both pods that way). By default the guard reads the pods' waiting queues only: a
    batching engine runs many requests at once, so a holder with more in flight is not a holder with a queue, and a
    guard on in-flight counts (`load_guard_in_flight`, off unless set) copied prefixes on the ordinary ups and downs
    of those counts, each copy a cold prefill that, under cache pressure, evicts another prefix (docs/decisions.md,
    18). A prefix with more traffic than its holders can take is the hot rule's to spread.

    A hot prefix gets holders in proportion to its traffic: when its share of recent picks (PrefixDemand, fading
    over `demand_window_seconds`) times the candidates exceeds `hot_share` times its holders, it wants more of
    the pool than its holders' fair part, and every candidate without it gets `hot_credit` of the holders'
    credit while every holder is serving requests. The load scorers then send it to a pod that does not hold it as
    soon as that pod is clearly less loaded, which copies it there once; from then on its holders share its traffic
    by load. A holder with nothing in flight keeps it (one client sending one request after another is the whole
    traffic of its prefix, and needs one pod). A prefix with a
    pod's share of the traffic or less keeps one holder, so caches under pressure are not spent on copies.

    A lopsided fleet gets the same treatment pod by pod: when every holder of a prefix took more than
    `crowded_share` fair shares (1/candidates) of the recent picks with this prefix's part left out (crowded by its
    other prefixes: a single prefix's traffic is the hot rule's to spread), the idle candidates under a fair share
    get `hot_credit` of the holders' credit too. A pod that joins empty (a restart, a scale-up) would otherwise get
    nothing but prompts nobody has cached while its peers queue; this way it takes prefixes one at a time (idle by
    our counts and its last scrape: never a second cold copy queued behind the first, nor a pod other replicas
    keep busy), each copied once, until no holder is crowded, which is what a hash ring's remapping does at once.
    Only a pod whose cache has room takes a crowded pod's prefix (the index holds fewer blocks for it than its cache
    has): under cache pressure a copy evicts another prefix that comes back cold, and the shares it would correct
    are often a short window's noise (the simulator's mirror of two real pods under pressure at 1 req/s: 3.4 copies
    a run, 0.013 of hit rate; docs/decisions.md).
    """

    type_name = "prefix-cache-scorer"
    needs_prefix = True

    def __init__(
        self,
        name: str | None = None,
        *,
        ratio_weight: float = 0.5,
        full_credit_chars: int = 4096,
        load_guard_in_flight: float | None = None,
        load_guard_waiting: float | None = 4,
        guard_penalty: float = 0.0,
        guard_ratio: float = 2.0,
        hot_share: float | None = 1.0,
        hot_credit: float = 0.9,
        crowded_share: float | None = 1.25,
        demand_window_seconds: float = 10.0,
        room: CacheRoom | None = None,
    ) -> None:
        super().__init__(name)
        if hot_share is not None and hot_share <= 0 or not 0.0 <= hot_credit <= 1.0 or demand_window_seconds <= 0:
            raise ValueError("hotShare must be positive, hotCredit within [0, 1], demandWindowSeconds positive")
        if crowded_share is not None and crowded_share <= 1.0:
            raise ValueError("crowdedShare must be above 1 (a fair share)")
        self.hot_share = hot_share
        self.hot_credit = hot_credit
        self.crowded_share = crowded_share
        self._room = room  # which pods' caches have room: crowding copies go only there (None: assume all do)
        wanted = hot_share is not None or crowded_share is not None
        self._demand = PrefixDemand(demand_window_seconds) if wanted else None
        if not 0.0 <= ratio_weight <= 1.0:
            raise ValueError("ratioWeight must be within [0, 1]")
        if guard_ratio < 1.0:
            raise ValueError("guardRatio must be at least 1")
        self.guard_ratio = guard_ratio
        if full_credit_chars <= 0:
            raise ValueError("fullCreditChars must be positive")
        self.ratio_weight = ratio_weight
        self.full_credit_chars = full_credit_chars
        self.load_guard_in_flight = load_guard_in_flight
        self.load_guard_waiting = load_guard_waiting
        self.guard_penalty = guard_penalty

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        total = len(ctx.keys)
        matched = ctx.matched
        if total == 0 or not any(matched):
            return [0.0] * len(candidates)
        r = self.ratio_weight
        per_block = (1.0 - r) * ctx.block_chars / self.full_credit_chars
        cap = 1.0 - r
        out = [(r * m / total + (cap if m * per_block > cap else m * per_block)) if m else 0.0 for m in matched]
        if self._demand is not None:
            self._credit_hot_prefix(ctx, candidates, out)
        guard_flight = self.load_guard_in_flight
        guard_wait = self.load_guard_waiting
        if guard_flight is not None or guard_wait is not None:
            min_flight = min([e.in_flight for e in candidates])
            min_wait = min([e.metrics.waiting for e in candidates])
            penalty, ratio = self.guard_penalty, self.guard_ratio
            for i in [i for i, m in enumerate(matched) if m]:
                e = candidates[i]
                flight, wait = e.in_flight, e.metrics.waiting
                if (
                    (guard_flight is not None and flight - min_flight >= guard_flight and flight >= ratio * min_flight)
                    or (guard_wait is not None and wait - min_wait >= guard_wait and wait >= ratio * min_wait)
                ):
                    out[i] *= penalty
        return out

    def _credit_hot_prefix(self, ctx: SchedulingContext, candidates: Sequence[Endpoint], out: list[float]) -> None:
        """Give the candidates without a hot prefix, or without the prefix of crowded holders, `hot_credit` of its
        holders' credit (class docstring)."""
        demand = self._demand
        assert demand is not None
        matched, now = ctx.matched, ctx.now
        depth = PrefixDemand.depth(ctx, max(matched))
        if not depth:
            return
        all_picks = demand.total(now)
        holders = [i for i, m in enumerate(matched) if m >= depth]
        # shares are of the whole candidate set, also when a sample of it is scored (SchedulingContext.sampled_from)
        n = ctx.sampled_from or len(candidates)
        held_by = sum(1 for m in ctx.matches.values() if m >= depth) if ctx.sampled_from else len(holders)
        if all_picks <= 0.0 or held_by >= n:  # every candidate holds it: nobody to copy it to
            return
        if any(candidates[i].in_flight == 0 for i in holders):
            return  # a holder is free: however much of the traffic wants it, it is not queueing anywhere
        picks = demand.of(ctx.keys[depth - 1], now)
        if self.hot_share is not None and picks * n > self.hot_share * held_by * all_picks:
            takers = [i for i, m in enumerate(matched) if m < depth]
        elif self.crowded_share is not None:
            # crowded: every holder took over `crowded_share` fair shares of the recent prefix picks without this
            # prefix's part (crowded by its other prefixes; a single prefix's traffic is the hot rule's to spread)
            counted = demand.counted(now)
            bar, part = self.crowded_share * counted / n, picks / held_by
            if counted <= 0.0 or any(demand.of_pod(candidates[i].address, now) - part <= bar for i in holders):
                return
            takers = [i for i, m in enumerate(matched) if m < depth and _idle(candidates[i])
                      and demand.of_pod(candidates[i].address, now) * n < counted
                      and (self._room is None or self._room.has_room(candidates[i].address))]
        else:
            return
        credit = self.hot_credit * max(out[i] for i in holders)
        for i in takers:
            if out[i] < credit:
                out[i] = credit

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        demand = self._demand
        if demand is None:
            return
        if ctx.matches:  # a prefix some pod holds, sent to a pod without it: a copy
            best = max(ctx.matches.values())
            depth = PrefixDemand.depth(ctx, best)
            if depth and ctx.matches.get(endpoint.address, 0) < depth:
                holders = [address for address, m in ctx.matches.items() if m >= depth]
                demand.copied(ctx.keys[depth - 1], holders, endpoint.address, ctx.now)
        demand.note(ctx, ctx.now, endpoint.address)

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        if self._demand is not None:
            self._demand.forget_pod(endpoint.address)


def _idle(endpoint: Endpoint) -> bool:
    """Nothing in flight from us and, at its last scrape, nothing running or waiting (other replicas' requests)."""
    m = endpoint.metrics
    return endpoint.in_flight == 0 and m.running == 0 and m.waiting == 0


class KVCacheUtilizationScorer(Plugin):
    """Free KV cache: 1 - vllm:kv_cache_usage_perc."""

    type_name = "kv-cache-utilization-scorer"

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        out = [1.0 - e.metrics.kv_usage for e in candidates]
        if min(out) < 0.0 or max(out) > 1.0:  # rare: clamp a bad reading once, not per pod
            out = [0.0 if x < 0.0 else 1.0 if x > 1.0 else x for x in out]
        return out


class QueueScorer(Plugin):
    """Shortest waiting queue, min-max normalised across candidates (GIE's queue scorer)."""

    type_name = "queue-scorer"

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        return min_max_inverse([e.metrics.waiting for e in candidates])


class InFlightLoadScorer(Plugin):
    """Our own in-flight count (+ tokens), which moves at once while scraped metrics lag by a poll.

    load = in_flight + in_flight_tokens / tokens_per_request (+ recent prefill, below);
    score = 1 - (load - min) / (max - min + slack): the slack keeps a one-request difference from looking like
    the whole range.

    With `prefill_half_life` > 0 the load also counts prompt tokens picked for the pod recently, decaying with
    that half-life: a pod that was just handed a prompt is busy prefilling it (what delays the next request's
    first token) even when in-flight counts are equal. Without it, ties are broken at random and arrivals bunch
    up on pods the way random routing does.
    """

    type_name = "in-flight-load-scorer"

    def __init__(self, name: str | None = None, *, tokens_per_request: float = 4096.0, slack: float = 1.0,
                 prefill_half_life: float = 0.0, prefill_weight: float = 1.0) -> None:
        super().__init__(name)
        if tokens_per_request <= 0 or slack < 0 or prefill_half_life < 0 or prefill_weight < 0:
            raise ValueError("tokensPerRequest must be positive; slack, prefillHalfLife, prefillWeight >= 0")
        self.tokens_per_request = tokens_per_request
        self.slack = slack
        self.prefill_weight = prefill_weight
        # prompt tokens picked for each pod lately (None: the term is off)
        self._recent = FadingTally(prefill_half_life) if prefill_half_life > 0 else None

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        unit = self.tokens_per_request
        loads = [e.in_flight + e.in_flight_tokens / unit for e in candidates]
        recent = self._recent
        if recent:
            # FadingTally.value inlined (one call per pod was a fifth of a decision at 1,000 pods); same arithmetic
            scale, half, now, get = self.prefill_weight / unit, recent.half_life, ctx.now, recent.entries.get
            for i, e in enumerate(candidates):
                entry = get(e.address)
                if entry is not None and entry[0]:
                    loads[i] = loads[i] + scale * (entry[0] * 0.5 ** ((now - entry[1]) / half))
        lo = min(loads)
        span = max(loads) - lo + self.slack
        if span <= 0:
            return [1.0] * len(loads)
        return [1.0 - (x - lo) / span for x in loads]

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        self._add_prefill(endpoint.address, ctx.prompt_tokens(), now)

    def on_peer_picked(self, pick: PeerPick, now: float) -> None:
        self._add_prefill(pick.address, pick.prompt_tokens, now)

    def _add_prefill(self, address: str, tokens: float, now: float) -> None:
        if self._recent is not None:
            self._recent.add(address, tokens, now)

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        if self._recent is not None:
            self._recent.forget(endpoint.address)


class LoraAffinityScorer(Plugin):
    """Prefer pods with the requested LoRA adapter loaded (vLLM: request.model names the adapter).

    running 1.0, room to load it (len(running) < max_lora) 0.8, queued for it 0.6, else 0. A model is an
    adapter when config declares it, or when it is not a configured base model and some pod lists it;
    requests for the base model score 1 everywhere.
    """

    type_name = "lora-affinity-scorer"

    def __init__(
        self, name: str | None = None, *, base_models: Sequence[str] = (), adapters: Sequence[str] = ()
    ) -> None:
        super().__init__(name)
        self.base_models = frozenset(base_models)
        self.adapters = frozenset(adapters)

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        model = ctx.model
        if model in self.base_models:
            return [1.0] * len(candidates)
        out: list[float] = []
        listed = False
        for e in candidates:
            m = e.metrics
            if model in m.running_loras:
                out.append(1.0)
                listed = True
            elif model in m.waiting_loras:
                listed = True
                out.append(0.8 if len(m.running_loras) < m.max_lora else 0.6)
            elif len(m.running_loras) < m.max_lora:
                out.append(0.8)
            else:
                out.append(0.0)
        if listed or model in self.adapters or self.base_models:
            return out
        return [1.0] * len(candidates)


class SessionAffinityScorer(Plugin):
    """Stick a session (x-session-id) to the endpoint that served it last: its KV cache has the history. Also the
    scheduler's `SessionMemory`: the cycle state's `session_pod` comes from here."""

    type_name = "session-affinity-scorer"

    def __init__(self, name: str | None = None, *, max_sessions: int = 10_000) -> None:
        super().__init__(name)
        if max_sessions <= 0:
            raise ValueError("maxSessions must be positive")
        self._last: PodMemory[str] = PodMemory(max_sessions)

    def session_pod(self, session: str) -> str | None:
        return self._last.get(session)

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        session = ctx.session
        address = self._last.get(session) if session else None
        if address is None:
            return [0.0] * len(candidates)
        return [1.0 if e.address == address else 0.0 for e in candidates]

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        self._remember(ctx.session, endpoint.address)

    def on_peer_picked(self, pick: PeerPick, now: float) -> None:
        self._remember(pick.session_id, pick.address)

    def _remember(self, session: str | None, address: str) -> None:
        if session:
            self._last.remember(session, address)

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        self._last.forget_pod(endpoint.address)

    def __len__(self) -> int:
        return len(self._last)


class PrefixCacheParams(Section):
    ratio_weight: float = Field(default_of(PrefixCacheScorer, "ratio_weight"), ge=0, le=1)
    full_credit_chars: int = Field(default_of(PrefixCacheScorer, "full_credit_chars"), gt=0)
    load_guard_in_flight: float | None = default_of(PrefixCacheScorer, "load_guard_in_flight")
    load_guard_waiting: float | None = default_of(PrefixCacheScorer, "load_guard_waiting")
    guard_penalty: float = Field(default_of(PrefixCacheScorer, "guard_penalty"), ge=0, le=1)
    guard_ratio: float = Field(default_of(PrefixCacheScorer, "guard_ratio"), ge=1)
    # null: one holder per prefix whatever its traffic
    hot_share: float | None = Field(default_of(PrefixCacheScorer, "hot_share"), gt=0)
    hot_credit: float = Field(default_of(PrefixCacheScorer, "hot_credit"), ge=0, le=1)
    # null: a pod's share of the traffic never moves a prefix
    crowded_share: float | None = Field(default_of(PrefixCacheScorer, "crowded_share"), gt=1)
    demand_window_seconds: float = Field(default_of(PrefixCacheScorer, "demand_window_seconds"), gt=0)


class InFlightLoadParams(Section):
    tokens_per_request: float = Field(default_of(InFlightLoadScorer, "tokens_per_request"), gt=0)
    slack: float = Field(default_of(InFlightLoadScorer, "slack"), ge=0)
    prefill_half_life: float = Field(default_of(InFlightLoadScorer, "prefill_half_life"), ge=0)
    prefill_weight: float = Field(default_of(InFlightLoadScorer, "prefill_weight"), ge=0)


class SessionAffinityParams(Section):
    max_sessions: int = Field(default_of(SessionAffinityScorer, "max_sessions"), gt=0)


def _prefix_cache(name: str, p: PrefixCacheParams, deps: PluginDeps) -> Plugin:
    return PrefixCacheScorer(name, **p.model_dump(), room=deps.cache_room)


def _in_flight(name: str, p: InFlightLoadParams, deps: PluginDeps) -> Plugin:
    return InFlightLoadScorer(name, **p.model_dump())


def _lora(name: str, p: NoParams, deps: PluginDeps) -> Plugin:
    return LoraAffinityScorer(name, base_models=deps.base_models, adapters=deps.adapters)


FACTORIES: tuple[PluginFactory[Any], ...] = (
    PluginFactory(PrefixCacheScorer.type_name, PrefixCacheParams, _prefix_cache),
    PluginFactory(KVCacheUtilizationScorer.type_name, NoParams, no_params(KVCacheUtilizationScorer)),
    PluginFactory(QueueScorer.type_name, NoParams, no_params(QueueScorer)),
    PluginFactory(InFlightLoadScorer.type_name, InFlightLoadParams, _in_flight),
    PluginFactory(LoraAffinityScorer.type_name, NoParams, _lora),
    PluginFactory(SessionAffinityScorer.type_name, SessionAffinityParams, with_params(SessionAffinityScorer)),
)
