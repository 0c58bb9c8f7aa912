"""PrefixAwareScheduler: run the prefix sources (`producers`), classify, filter, score, pick.

Pure: reads the request, the endpoint snapshot, the index and `now`; mutates only its own learning state
(index, session map, spread counters) and only in `on_picked` / `on_endpoint_removed`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple, cast

import numpy as np

from picker.core.requests import InferenceRequest, RequestError
from picker.endpoints.state import Endpoint
from picker.prefix.hashing import PrefixHasher
from picker.prefix.index import PrefixIndex
from picker.prefix.memory import InMemoryPrefixIndex
from picker.scheduling.context import SchedulingContext, effective_model
from picker.scheduling.plugins import PeerPick, Plugin, PluginTimer, Scorer, SessionMemory
from picker.scheduling.producers import ApproximatePrefix, PrefixProducer
from picker.scheduling.profiles import Classifier, Profile, SingleProfile
from picker.scheduling.types import CandidateScore, Disaggregation, SchedulingResult


class PrefixAwareScheduler:
    """Implements `Scheduler` with named profiles; `classifier` chooses the profile for each request."""

    def __init__(
        self,
        profiles: Sequence[Profile],
        classifier: Classifier | None = None,
        *,
        index: PrefixIndex | None = None,
        hasher: PrefixHasher | None = None,
        explain: bool = True,
        timer: PluginTimer | None = None,
        producers: Sequence[PrefixProducer] | None = None,
    ) -> None:
        if not profiles:
            raise ValueError("at least one scheduling profile is needed")
        self.profiles = {p.name: p for p in profiles}
        if len(self.profiles) != len(profiles):
            raise ValueError("scheduling profile names must be unique")
        self.classifier: Classifier = classifier if classifier is not None else SingleProfile(profiles[0].name)
        self.hasher = hasher if hasher is not None else PrefixHasher()
        self.explain = explain  # per-candidate score breakdown in the result (the Explain API reads it)
        self.timer = timer  # times the plugins of some requests (llm_d_epp_plugin_duration_seconds)
        self._index: PrefixIndex = index if index is not None else InMemoryPrefixIndex()
        # the prefix sources, in the order they run (build_scheduler takes them from the plugin table); built
        # directly, a scheduler reads its index alone
        self.producers: list[PrefixProducer] = (list(producers) if producers is not None
                                                else [ApproximatePrefix(self._index, self.hasher)])
        self.uses_prefix = any(p.uses_prefix for p in profiles) or self.classifier.needs_prefix
        seen: dict[int, Plugin] = {}
        for profile in profiles:
            for plugin in profile.plugins():
                seen.setdefault(id(plugin), plugin)
        if isinstance(self.classifier, Plugin):
            seen.setdefault(id(self.classifier), self.classifier)
        self._plugins = list(seen.values())
        self._stateful = [p for p in self._plugins if _overrides_hooks(p)]
        self._sessions = [p for p in self._plugins if isinstance(p, SessionMemory)]

    @property
    def index(self) -> PrefixIndex:
        return self._index

    @property
    def chars_per_token(self) -> int:
        return self.hasher.chars_per_token

    @property
    def learned_chars_per_token(self) -> float | None:
        for producer in self.producers:
            value = producer.learned_chars_per_token()
            if value is not None:
                return value
        return None

    @property
    def may_disaggregate(self) -> bool:
        return self.classifier.disaggregates

    def context(self, request: InferenceRequest, endpoints: Sequence[Endpoint], now: float) -> SchedulingContext:
        """The request's cycle state: its session key and pod, and what the prefix sources know of its prompt."""
        ctx = SchedulingContext(request=request, now=now, model=effective_model(request),
                                chars_per_token=self.hasher.chars_per_token)
        if request.session_id:
            ctx.session = session = self.hasher.key.session(request.session_id)
            for memory in self._sessions:
                ctx.session_pod = memory.session_pod(session)
                if ctx.session_pod is not None:
                    break
        if self.uses_prefix and request.prompt_text:
            for producer in self.producers:
                producer.produce(ctx, endpoints, now)
        return ctx

    def schedule(self, request: InferenceRequest, endpoints: Sequence[Endpoint], now: float) -> SchedulingResult:
        if not endpoints:
            raise RequestError(503, "no_endpoints", "no candidate endpoints")
        ctx = self.context(request, endpoints, now)
        handler = self.classifier
        profile = self._profile(handler.classify(ctx))
        timer = self.timer if self.timer is not None and self.timer.plugin_timing_due() else None
        run = self._run(profile, ctx, endpoints, timer)
        if not run.candidates:
            raise RequestError(503, "no_endpoints", "every candidate endpoint was filtered out")
        ranked = [run.candidates[i] for i in run.order]
        matched = ctx.matched[run.order[0]] if run.order else 0
        disaggregation = None
        if ranked:
            second = handler.prefill_profile(ctx, ranked[0])
            prefill = self._prefill(self._profile(second), ctx, endpoints, timer) if second is not None else None
            disaggregation = handler.decided(ctx, prefill)
        if not self.explain:
            return SchedulingResult(ranked, profile.name, [], len(ctx.keys), matched, ctx, disaggregation)
        return ExplainedResult(ranked, profile, len(ctx.keys), matched, ctx, run, disaggregation, handler)

    def _profile(self, name: str) -> Profile:
        profile = self.profiles.get(name)
        if profile is None:
            raise RequestError(500, "bad_profile", "classifier chose an unknown scheduling profile")
        return profile

    def _run(self, profile: Profile, ctx: SchedulingContext, endpoints: Sequence[Endpoint],
             timer: PluginTimer | None) -> _Run:
        """One profile over the endpoints: its filters, then its weighted scorers and its picker. The pool's own
        list goes to the first filter uncopied (filters return new lists; none changes the one it is given)."""
        candidates = endpoints if isinstance(endpoints, list) else list(endpoints)
        ctx.start_profile()
        steps: _Steps = []  # filters that removed someone
        for f in profile.filters:
            began = time.perf_counter() if timer is not None else 0.0
            kept = f.filter(ctx, candidates)
            if timer is not None:
                timer.observe_plugin("Filter", f.type_name, f.name, time.perf_counter() - began)
            if len(kept) != len(candidates):
                steps.append((f.name, candidates, kept))
            candidates = kept
        if not candidates:
            return _Run(candidates, [], [], [], [], steps)
        ctx.align(candidates)
        names = [w.scorer.name for w in profile.scorers]
        if timer is None:
            columns = [w.scorer.score(ctx, candidates) for w in profile.scorers]
        else:
            columns = [_timed_score(timer, w.scorer, ctx, candidates) for w in profile.scorers]
        totals = _weighted_totals(columns, profile.weights, len(candidates))
        began = time.perf_counter() if timer is not None else 0.0
        order = profile.picker.pick(totals)
        if timer is not None:
            timer.observe_plugin("Picker", profile.picker.type_name, profile.picker.name, time.perf_counter() - began)
        return _Run(candidates, order, names, columns, totals, steps)

    def _prefill(self, profile: Profile, ctx: SchedulingContext, endpoints: Sequence[Endpoint],
                 timer: PluginTimer | None) -> Endpoint | None:
        """The prefill profile's pick, or None when no pod survives its filters (decode-only, not an error), run
        beside the request's own (`side_run`: what its plugins keep is dropped)."""
        with ctx.side_run():
            run = self._run(profile, ctx, endpoints, timer)
        return run.candidates[run.order[0]] if run.order else None

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        for producer in self.producers:
            producer.on_picked(ctx, endpoint, now)
            if ctx.prefill is not None:  # the prefill pod computed the prompt too: it holds its prefix as well
                producer.on_picked(ctx, ctx.prefill, now)
        for plugin in self._stateful:
            plugin.on_picked(ctx, endpoint, now)

    def on_peer_picked(self, pick: PeerPick, now: float) -> None:
        """Another replica sharing our prefix index routed a request (the shared index reports it)."""
        for producer in self.producers:
            producer.on_peer_picked(pick, now)
        for plugin in self._stateful:
            plugin.on_peer_picked(pick, now)

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        for producer in self.producers:
            producer.on_endpoint_removed(endpoint)
        for plugin in self._stateful:
            plugin.on_endpoint_removed(endpoint)


def _timed_score(timer: PluginTimer, scorer: Scorer, ctx: SchedulingContext, candidates: list[Endpoint]) -> list[float]:
    began = time.perf_counter()
    scores = scorer.score(ctx, candidates)
    timer.observe_plugin("Scorer", scorer.type_name, scorer.name, time.perf_counter() - began)
    return scores


# From this many candidates on, summing the weighted columns in numpy beats the list loop (bench: ~2x at 512).
_NUMPY_MIN_CANDIDATES = 96


def _weighted_totals(columns: list[list[float]], weights: list[float], n: int) -> list[float]:
    """Per-candidate sum of weight x score. Both paths add the columns in the same order for every candidate,
    so candidates with equal scores get bit-identical totals and the picker's random tie-break still applies."""
    if n >= _NUMPY_MIN_CANDIDATES and columns:
        stacked = np.array(columns, dtype=np.float64)
        stacked *= np.array(weights, dtype=np.float64)[:, None]
        return cast("list[float]", stacked.sum(axis=0).tolist())
    totals = [0.0] * n
    for w, scores in zip(weights, columns, strict=True):
        totals = [t + w * x for t, x in zip(totals, scores, strict=True)]
    return totals


def _by_total(c: CandidateScore) -> float:
    return c.total


def _overrides_hooks(plugin: Plugin) -> bool:
    cls = type(plugin)
    return (cls.on_picked is not Plugin.on_picked or cls.on_peer_picked is not Plugin.on_peer_picked
            or cls.on_endpoint_removed is not Plugin.on_endpoint_removed)


_Steps = list[tuple[str, list[Endpoint], list[Endpoint]]]


class _Run(NamedTuple):
    """What one profile made of the endpoints: survivors, their ranking (indices), and the scores behind it."""

    candidates: list[Endpoint]
    order: list[int]
    names: list[str]
    columns: list[list[float]]
    totals: list[float]
    steps: _Steps



class ExplainedResult(SchedulingResult):
    """A SchedulingResult whose per-candidate breakdown is built on first read of `candidates`.

    Routing never reads it, and building one CandidateScore (+ dict) per pod was ~40 % of a decision at 512
    pods; the Explain API and traces read it and get exactly the scores computed at decision time.
    """

    __slots__ = ("_breakdown", "_candidates", "_profile", "_classifier")

    def __init__(
        self, ranked: list[Endpoint], profile: Profile, prefix_blocks: int, prefix_matched_blocks: int,
        context: SchedulingContext, breakdown: _Run, disaggregation: Disaggregation | None, classifier: Classifier,
    ) -> None:
        self._breakdown: _Run | None = breakdown
        self._profile = profile
        self._classifier = classifier
        super().__init__(ranked, profile.name, [], prefix_blocks, prefix_matched_blocks, context, disaggregation)

    @property
    def weights(self) -> dict[str, float]:
        return {w.scorer.name: w.weight for w in self._profile.scorers}

    @property
    def profile_reason(self) -> str:
        return self._classifier.reason(self.context) if self.context is not None else ""

    @property  # type: ignore[override]
    def candidates(self) -> list[CandidateScore]:
        breakdown = self._breakdown
        if breakdown is not None:
            self._breakdown = None
            endpoints, _, names, columns, totals, steps = breakdown
            rows = zip(*columns, strict=True) if columns else ((),) * len(endpoints)
            built = [
                CandidateScore(e, dict(zip(names, row, strict=True)), t)
                for e, row, t in zip(endpoints, rows, totals, strict=True)
            ]
            ctx = self.context
            if ctx is not None and ctx.keys:  # what the index expects each candidate to hold of this prompt
                for candidate in built:
                    address = candidate.endpoint.address
                    candidate.details["prefix.expected_chars"] = float(ctx.matches.get(address, 0) * ctx.block_chars)
                    candidate.details["prefix.precise"] = 1.0 if address in ctx.precise_pods else 0.0
                    if ctx.precise_offloaded:
                        candidate.details["prefix.offloaded_tokens"] = float(ctx.precise_offloaded.get(address, 0))
            notes = ctx.details if ctx is not None else None
            for plugin, per_candidate in (notes or {}).items():
                for candidate, detail in zip(built, per_candidate, strict=True):
                    candidate.details.update({f"{plugin}.{k}": v for k, v in detail.explain().items()})
            built.sort(key=_by_total, reverse=True)
            for name, before, kept in steps:
                survivors = {id(e) for e in kept}
                built.extend(CandidateScore(e, filtered_by=name) for e in before if id(e) not in survivors)
            self._candidates = built
        return self._candidates

    @candidates.setter
    def candidates(self, value: list[CandidateScore]) -> None:
        self._candidates = value
