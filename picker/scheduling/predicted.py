"""Predicted time to first token: route to the pod expected to start streaming this request soonest.

For each candidate pod the scorer predicts, in seconds,

    TTFT = wait + prefill(uncached) + decode,    prefill(n) = fixed + per_token x n

- `uncached`: this request's prompt tokens minus the prefix the index says the pod holds;
- `wait`: prefill work ahead of it on that pod: each pick we route there keeps it busy for prefill(its uncached
  tokens) after the work before it, or, when the pod reports a longer queue (traffic from elsewhere), its
  waiting requests each worth prefill(the mean uncached prompt we route);
- `decode`: every step that computes a prefill chunk also runs the pod's running requests' decodes, so each one
  costs `decodeTokens` prefill tokens' worth of time.
The affine cost matters for short prompts: a prefill of 50 tokens takes an engine step however few its tokens,
so two short prompts sent to one pod a moment apart queue behind each other's step, which a cost per token alone
prices at almost nothing (round-robin beat such a model on short chat prompts). `fixed` and `per_token` are fitted
to what vLLM reports between scrapes (`vllm:request_prefill_time_seconds` sum and count against
`vllm:request_prefill_kv_computed_tokens`; `PrefillCost`), one fit for the pool (its pods are alike; per pod with
`perPodRate`), starting from the priors `prefillFixedSeconds` and `prefillTokensPerSecond`. When every request
is alike the slope cannot be told from the data and stays near its prior, which then sets how much a cached
prefix is worth against a wait: the defaults (7.5 ms, 25,000 tokens/s, an 8B model on one GPU) were chosen on
the fast-mode sweep (bench/studies/predicted-ttft.md, "Predicted TTFT").

A cold prefill also costs the future: once we have had a pod prefill as many tokens as its KV cache holds, each
uncached token it writes evicts a cached one that a later request will prefill again, so the uncached part is
priced `evictionCost` times more in proportion to how full we have made that cache. Without it the model copied
prefixes onto pods whose caches could not hold them twice (two real vLLM pods, bench/README.md) and lost hits.

A copy of a prefix another pod holds is an investment: its prefill and what it evicts are paid once, and from
then on the requests that want the prefix have one more pod to go to. Charged whole to the request that makes it,
it is never worth one request's wait, so a prefix most of the traffic wants stayed on the pods that first got it,
its requests queueing and batching behind each other (`hot-prefix` p90 5-14 % behind the weighted defaults,
which spread it further). So the tokens a candidate lacks of the longest prefix some pod holds are charged only in
share, 1 / (1 + F), where F, the requests the new copy can expect, is this prefix's picks (each fading with time
constant `demandWindowSeconds`) divided among its holders and the new one, less `demandFloor` (a short burst, such
as one file's completions in an editor, is not worth a copy). A prefix wanted by a few requests is priced as
before; only sustained demand copies it, and a holder that does not queue is still preferred. Demand is counted
from this replica's own picks (a peer's pick carries no prefix keys), so N replicas each see about 1/N of it.

Times are kept on the pods' clock: the costs are learned from the seconds they report, and a pod's queue drains
at their pace. For real engines that is ours; pods simulated at a time scale (`picker sim --time-scale 0.5`: half
a model second per wall second) report model seconds, and `podTimeScale` must be that scale, or every queue looks
drained too soon and waits are priced too low against prefills (live `chat` 1-6 % behind the defaults at
`podTimeScale` 1, level at the sim's scale: bench/README.md).

The score is min(predicted) / predicted, in (0, 1]: the pod predicted fastest scores 1, one predicted twice as slow
0.5, so a profile that weighs this scorer alone picks the minimum, and small weights on the prefix and load scorers
only break its ties. A cold prefill on an idle pod and a wait behind a long queue on the pod that holds the prefix
are compared in the same currency: seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from picker.core.schema import Section
from picker.endpoints.state import Endpoint
from picker.scheduling.context import SchedulingContext
from picker.scheduling.demand import DEMAND_KEYS, PrefixDemand
from picker.scheduling.plugins import (
    PeerPick,
    Plugin,
    PluginDeps,
    PluginFactory,
    PredictionObserver,
    default_of,
)


class PrefillCost:
    """Seconds a pod spends prefilling one request: `fixed` + `per_token` x its uncached tokens.

    The fixed part is what a prefill costs however short it is (the engine step that carries it: weights read once,
    the running requests' decodes in the same step); the per-token part is the matmuls. Fitted by weighted least
    squares on what the pods report between two scrapes (requests prefilled, their uncached tokens, their prefill
    seconds: one point per window at the window's mean), old windows fading by `forget`, and two pseudo-points of
    the prior (a short and a `prior_tokens` prefill) that never fade, so windows that all look alike do not
    leave the slope undetermined."""

    __slots__ = ("forget", "fixed", "per_token", "_w", "_wx", "_wxx", "_wy", "_wxy", "_prior")

    def __init__(self, fixed: float, per_token: float, *, forget: float, prior_weight: float = 1.0,
                 prior_tokens: float = 1024.0) -> None:
        self.forget = forget
        self.fixed = fixed
        self.per_token = per_token
        # (sum w, sum w x, sum w x^2, sum w y, sum w x y) of the prior's two points, added to every fit
        pts = ((0.0, fixed), (prior_tokens, fixed + per_token * prior_tokens))
        self._prior = (2 * prior_weight, prior_weight * sum(x for x, _ in pts), prior_weight * sum(x * x for x, _ in pts),
                       prior_weight * sum(y for _, y in pts), prior_weight * sum(x * y for x, y in pts))
        self._w = self._wx = self._wxx = self._wy = self._wxy = 0.0

    def seconds(self, tokens: float) -> float:
        return self.fixed + self.per_token * tokens

    def learn(self, requests: float, tokens: float, seconds: float) -> None:
        """One window: `requests` prefills of `tokens` uncached tokens in all took `seconds`."""
        x, y, w = tokens / requests, seconds / requests, requests
        keep = 1.0 - self.forget
        self._w = keep * self._w + w
        self._wx = keep * self._wx + w * x
        self._wxx = keep * self._wxx + w * x * x
        self._wy = keep * self._wy + w * y
        self._wxy = keep * self._wxy + w * x * y
        pw, pwx, pwxx, pwy, pwxy = self._prior
        sw, swx, swxx, swy, swxy = self._w + pw, self._wx + pwx, self._wxx + pwxx, self._wy + pwy, self._wxy + pwxy
        det = sw * swxx - swx * swx
        slope = (sw * swxy - swx * swy) / det if det > 0.0 else 0.0
        if slope <= 0.0:  # no visible per-token cost: all of it fixed, at least a sliver per token
            slope = 1e-9
        fixed = (swy - slope * swx) / sw
        if fixed < 0.0:  # a line through the origin instead
            fixed, slope = 0.0, max(swxy / swxx, 1e-9)
        self.fixed, self.per_token = fixed, slope


@dataclass(slots=True)
class _Pod:
    """What the scorer knows of one pod's prefill pipeline."""

    cost: PrefillCost  # its own (perPodRate), else the pool's shared one
    busy_until: float = 0.0  # when the prefills we routed here should be done (our clock)
    peer_until: float = 0.0  # the same for other replicas' picks, which our in-flight counts do not hold
    written: float = 0.0  # prompt tokens we had it prefill (and cache) since it joined
    seen_tokens: float = -1.0  # vllm:request_prefill_kv_computed_tokens_sum at the last scrape read
    seen_seconds: float = 0.0  # vllm:request_prefill_time_seconds sum and count at the last scrape read
    seen_count: float = 0.0
    seen_at: float = -1.0  # the scrape's updated_at
    seen_ttft_seconds: float = -1.0  # vllm:time_to_first_token_seconds sum and count at the last scrape read
    seen_ttft_count: float = 0.0
    predicted_sum: float = 0.0  # predictions of the requests picked for this pod since that scrape
    predicted_n: int = 0


@dataclass(frozen=True, slots=True)
class Prediction:
    """One candidate's predicted TTFT and its parts, for Explain and traces."""

    seconds: float
    wait_s: float
    uncached_tokens: float
    prefill_s: float
    decode_s: float
    copy_share: float = 1.0  # the part of copying the prefix held elsewhere charged to this request

    def explain(self) -> dict[str, float]:
        return {"predicted_ms": self.seconds * 1e3, "wait_ms": self.wait_s * 1e3,
                "uncached_tokens": self.uncached_tokens, "prefill_ms": self.prefill_s * 1e3,
                "decode_ms": self.decode_s * 1e3, "copy_share": self.copy_share}


class PredictedTTFTScorer(Plugin):
    """Scores each candidate by min(predicted TTFT) / its predicted TTFT (module docstring)."""

    type_name = "predicted-ttft-scorer"
    needs_prefix = True

    def __init__(self, name: str | None = None, *, prefill_tokens_per_second: float = 25_000.0,
                 prefill_fixed_seconds: float = 0.0075, decode_tokens: float = 4.0, queued_request_tokens: float = 1024.0,
                 rate_smoothing: float = 0.2, min_rate_sample_tokens: float = 256.0, per_pod_rate: bool = False,
                 eviction_cost: float = 2.0, demand_window_seconds: float = 1.0, demand_floor: float = 4.0,
                 demand_keys: int = DEMAND_KEYS, pod_time_scale: float = 1.0,
                 observer: PredictionObserver | None = None) -> None:
        super().__init__(name)
        if prefill_tokens_per_second <= 0 or queued_request_tokens <= 0:
            raise ValueError("prefillTokensPerSecond and queuedRequestTokens must be positive")
        if decode_tokens < 0 or not 0 < rate_smoothing <= 1 or min_rate_sample_tokens < 0 or prefill_fixed_seconds < 0:
            raise ValueError("decodeTokens >= 0, rateSmoothing within (0, 1], minRateSampleTokens >= 0, "
                             "prefillFixedSeconds >= 0")
        self.prior = (prefill_fixed_seconds, 1.0 / prefill_tokens_per_second)
        self.decode_tokens = decode_tokens
        self.eviction_cost = eviction_cost
        self.rate_smoothing = rate_smoothing
        self.min_rate_sample_tokens = min_rate_sample_tokens
        self.mean_uncached = queued_request_tokens  # tokens a queued request will need (learned from our picks)
        # Pods of one pool run the same model on the same hardware: by default they share one learned cost, so
        # one pod's noisy samples do not make it look faster than its twins (and draw their traffic).
        self.per_pod_rate = per_pod_rate
        self.pool_cost = self._new_cost()
        self.observer = observer
        self._pods: dict[str, _Pod] = {}
        if demand_window_seconds < 0 or demand_floor < 0 or demand_keys < 1:
            raise ValueError("demandWindowSeconds and demandFloor must be >= 0")
        self.demand_floor = demand_floor
        # None (window 0): every cold copy is charged whole
        self._demand = PrefixDemand(demand_window_seconds, demand_keys) if demand_window_seconds else None
        if pod_time_scale <= 0:
            raise ValueError("podTimeScale must be positive")
        # The pods report prefill seconds on their clock; our queue and demand times are kept on it too (module
        # docstring): its seconds per second of ours, 1 for real engines.
        self.pod_time_scale = pod_time_scale

    def _new_cost(self) -> PrefillCost:
        return PrefillCost(*self.prior, forget=self.rate_smoothing)

    def _pod_state(self, address: str) -> _Pod:
        pod = self._pods.get(address)
        if pod is None:
            pod = self._pods[address] = _Pod(self._new_cost() if self.per_pod_rate else self.pool_cost)
        return pod

    def _pod(self, endpoint: Endpoint) -> _Pod:
        pod = self._pod_state(endpoint.address)
        m = endpoint.metrics
        if m.updated_at != pod.seen_at:
            self._learn(pod, m.prefill_count, m.prefill_tokens, m.prefill_seconds)
            self._compare(endpoint, pod, m.ttft_seconds, m.ttft_count)
            pod.seen_at = m.updated_at
        return pod

    def _compare(self, endpoint: Endpoint, pod: _Pod, ttft_seconds: float, ttft_count: float) -> None:
        """Report the mean TTFT the pod measured since the last scrape against what we predicted for the requests
        we sent it meanwhile (the two sets differ by the few requests still before their first token)."""
        if self.observer is not None and pod.seen_ttft_seconds >= 0 and ttft_count > pod.seen_ttft_count \
                and pod.predicted_n:
            observed = (ttft_seconds - pod.seen_ttft_seconds) / (ttft_count - pod.seen_ttft_count)
            self.observer.observe_prediction(endpoint, pod.predicted_sum / pod.predicted_n, observed)
        if ttft_count != pod.seen_ttft_count or pod.seen_ttft_seconds < 0:
            pod.seen_ttft_seconds, pod.seen_ttft_count = ttft_seconds, ttft_count
            pod.predicted_sum, pod.predicted_n = 0.0, 0

    def _learn(self, pod: _Pod, count: float, tokens: float, seconds: float) -> None:
        """Fold the prefills finished since the last sample into the cost model. Windows with fewer than
        `min_rate_sample_tokens` accumulate into a later one; counters that went back (the pod restarted) start
        over."""
        if pod.seen_tokens < 0 or tokens < pod.seen_tokens or seconds < pod.seen_seconds or count < pod.seen_count:
            pod.seen_tokens, pod.seen_seconds, pod.seen_count = tokens, seconds, count
            return
        d_count, d_tokens, d_seconds = count - pod.seen_count, tokens - pod.seen_tokens, seconds - pod.seen_seconds
        if d_tokens >= self.min_rate_sample_tokens and d_seconds > 0 and d_count > 0:
            pod.cost.learn(d_count, d_tokens, d_seconds)
            pod.seen_tokens, pod.seen_seconds, pod.seen_count = tokens, seconds, count

    def predict(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[Prediction]:
        """Each candidate's predicted TTFT (needs `ctx.matched` aligned with `candidates`)."""
        prompt = ctx.prompt_tokens()
        now = ctx.now * self.pod_time_scale
        block_tokens = ctx.tokens(ctx.block_chars)
        matched = ctx.matched or [0] * len(candidates)
        best = max(matched) if matched else 0
        share = 1.0
        depth = PrefixDemand.depth(ctx, best) if self._demand is not None else 0
        if self._demand is not None and depth:
            # the requests a new copy can expect: recent picks of this prefix shared with the holders and it
            holders = sum(1 for m in matched if m >= depth)
            future = self._demand.of(ctx.keys[depth - 1], now) / (holders + 1) - self.demand_floor
            if future > 0.0:
                share = 1.0 / (1.0 + future)
        return [self._predict_one(e, self._pod(e), prompt - blocks * block_tokens, now,
                                  (best - blocks) * block_tokens, share)
                for e, blocks in zip(candidates, matched, strict=True)]

    def _predict_one(self, e: Endpoint, pod: _Pod, uncached: float, now: float, replicable: float = 0.0,
                     share: float = 1.0) -> Prediction:
        if uncached < 0.0:
            uncached = 0.0
        cost = pod.cost
        if e.in_flight == 0 and pod.busy_until > now:  # everything we sent it has been answered: prefilled too
            pod.busy_until = now
        wait = (pod.busy_until if pod.busy_until > pod.peer_until else pod.peer_until) - now
        if wait < 0.0:
            wait = 0.0
        queued = e.metrics.waiting * cost.seconds(self.mean_uncached)
        if queued > wait:
            wait = queued
        running = e.metrics.running if e.metrics.running > e.in_flight else e.in_flight
        decode = running * self.decode_tokens * cost.per_token
        priced = uncached
        if share < 1.0 and replicable > 0.0:
            priced -= (1.0 - share) * (replicable if replicable < uncached else uncached)
        else:
            share = 1.0
        prefill = cost.seconds(priced)
        if self.eviction_cost and priced:
            m = e.metrics
            if m.num_gpu_blocks and m.block_size:
                full = pod.written / (m.num_gpu_blocks * m.block_size)
                prefill += self.eviction_cost * (full if full < 1.0 else 1.0) * cost.per_token * priced
        return Prediction(wait + prefill + decode, wait, uncached, prefill, decode, share)

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        predictions = self.predict(ctx, candidates)
        ctx.note(self.name, predictions)
        seconds = [p.seconds for p in predictions]
        best = min(seconds)
        slo = ctx.request.slo_ttft_s
        if slo is not None:
            # A TTFT objective: every pod predicted to meet it is as good as the fastest (the prefix and load
            # tie-breaks then choose among them: keep the cache, spread the load); the others rank below, fastest
            # first. None meeting it: the director may shed the request (sheddable ones only).
            ctx.slo_attainable = best <= slo
            return [1.0 if s <= slo else 0.5 * (best / s if s > 0.0 else 1.0) for s in seconds]
        if best <= 0.0:
            return [1.0 if s <= 0.0 else 0.0 for s in seconds]
        return [best / s for s in seconds]

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        now *= self.pod_time_scale
        pod = self._pod(endpoint)
        uncached = ctx.uncached_tokens(endpoint.address)
        if self.observer is not None:  # what we expected of this pick, before it joins the pod's queue
            pod.predicted_sum += self._predict_one(endpoint, pod, uncached, now).seconds
            pod.predicted_n += 1
        pod.busy_until = self._queue_behind(pod, uncached, now)
        pod.written += uncached
        if self._demand is not None:
            self._demand.note(ctx, ctx.now * self.pod_time_scale)

    def on_peer_picked(self, pick: PeerPick, now: float) -> None:
        """A peer's pick carries no match length: count its whole prompt (an overestimate, as long as it lasts)."""
        pod = self._pod_state(pick.address)
        now *= self.pod_time_scale
        pod.peer_until = self._queue_behind(pod, pick.prompt_tokens, now)

    def _queue_behind(self, pod: _Pod, tokens: float, now: float) -> float:
        """When a prefill of `tokens` sent now should be done: after the work already routed there."""
        self.mean_uncached += 0.05 * (tokens - self.mean_uncached)
        return max(now, pod.busy_until, pod.peer_until) + pod.cost.seconds(tokens)

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        self._pods.pop(endpoint.address, None)


class PredictedTTFTParams(Section):
    # priors of the cost model, until the pods report
    prefill_tokens_per_second: float = Field(default_of(PredictedTTFTScorer, "prefill_tokens_per_second"), gt=0)
    # what any prefill costs however short (an engine step)
    prefill_fixed_seconds: float = Field(default_of(PredictedTTFTScorer, "prefill_fixed_seconds"), ge=0)
    # prefill tokens' worth of time one running request adds
    decode_tokens: float = Field(default_of(PredictedTTFTScorer, "decode_tokens"), ge=0)
    # prior for a queued request's uncached prompt
    queued_request_tokens: float = Field(default_of(PredictedTTFTScorer, "queued_request_tokens"), gt=0)
    # how much of the fit each new window replaces
    rate_smoothing: float = Field(default_of(PredictedTTFTScorer, "rate_smoothing"), gt=0, le=1)
    min_rate_sample_tokens: float = Field(default_of(PredictedTTFTScorer, "min_rate_sample_tokens"), ge=0)
    # learn each pod's rate apart (a pool of unlike pods) instead of one for all
    per_pod_rate: bool = default_of(PredictedTTFTScorer, "per_pod_rate")
    # cold tokens on a full cache evict as many: priced this many times
    eviction_cost: float = Field(default_of(PredictedTTFTScorer, "eviction_cost"), ge=0)
    # how long a pick counts as demand for its prefix (0: off)
    demand_window_seconds: float = Field(default_of(PredictedTTFTScorer, "demand_window_seconds"), ge=0)
    # requests per holder a prefix needs before a copy is worth it
    demand_floor: float = Field(default_of(PredictedTTFTScorer, "demand_floor"), ge=0)
    # the pods' clock against ours: 1, or `picker sim --time-scale`
    pod_time_scale: float = Field(default_of(PredictedTTFTScorer, "pod_time_scale"), gt=0)


def _predicted(name: str, p: PredictedTTFTParams, deps: PluginDeps) -> Plugin:
    kwargs: dict[str, Any] = p.model_dump()
    return PredictedTTFTScorer(name, **kwargs, observer=deps.observer)


FACTORIES: tuple[PluginFactory[Any], ...] = (
    PluginFactory(PredictedTTFTScorer.type_name, PredictedTTFTParams, _predicted),
)
