"""Predicted time to first token: route to the pod expected to start streaming this request soonest.

For each candidate pod the scorer predicts

    TTFT = (wait + uncached + decode) / rate

in tokens of prefill work and the pod's prefill rate (tokens per second):
- `uncached`: this request's prompt tokens minus the prefix the index says the pod holds;
- `wait`: prefill work ahead of it on that pod: what we routed there and it has not yet computed (each pick adds
  its uncached tokens, the pod works them off at `rate`), or, when the pod reports a longer queue than that
  (traffic from elsewhere), its waiting requests times the mean uncached prompt we route;
- `decode`: every step that computes a prefill chunk also runs the pod's running requests' decodes, so each one
  costs the prefill `decodeTokens` tokens' worth of time.
`rate` is learned per pod from what vLLM itself reports (the deltas of `vllm:request_prefill_kv_computed_tokens`
over `vllm:request_prefill_time_seconds` between scrapes, smoothed), starting from `prefillTokensPerSecond`. The
ranking is mostly free of the prior (wait and uncached are in the same unit); the rate sets how fast routed work
drains and the figures Explain shows in milliseconds.

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

from picker.endpoints.state import Endpoint
from picker.prefix.hashing import CHARS_PER_TOKEN
from picker.scheduling.context import SchedulingContext
from picker.scheduling.plugins import PeerPick, Plugin, PluginDeps, PluginFactory, PredictionObserver
from picker.schema import Section


@dataclass(slots=True)
class _Pod:
    """What the scorer knows of one pod's prefill pipeline."""

    rate: float  # prefill tokens per second (learned)
    backlog: float = 0.0  # tokens of prefill routed here and not yet computed, as of `at`
    at: float = 0.0
    seen_tokens: float = -1.0  # vllm:request_prefill_kv_computed_tokens_sum at the last scrape read
    seen_seconds: float = 0.0  # vllm:request_prefill_time_seconds_sum at the last scrape read
    seen_at: float = -1.0  # the scrape's updated_at
    seen_ttft_seconds: float = -1.0  # vllm:time_to_first_token_seconds sum and count at the last scrape read
    seen_ttft_count: float = 0.0
    predicted_sum: float = 0.0  # predictions of the requests picked for this pod since that scrape
    predicted_n: int = 0

    def backlog_at(self, now: float, rate: float) -> float:
        left = self.backlog - rate * (now - self.at)
        return left if left > 0.0 else 0.0


@dataclass(frozen=True, slots=True)
class Prediction:
    """One candidate's predicted TTFT and its parts, for Explain and traces."""

    seconds: float
    wait_tokens: float
    uncached_tokens: float
    decode_tokens: float
    rate: float

    def explain(self) -> dict[str, float]:
        return {"predicted_ms": self.seconds * 1e3, "wait_tokens": self.wait_tokens,
                "uncached_tokens": self.uncached_tokens, "decode_tokens": self.decode_tokens,
                "prefill_tokens_per_s": self.rate}


class PredictedTTFTScorer(Plugin):
    """Scores each candidate by min(predicted TTFT) / its predicted TTFT (module docstring)."""

    type_name = "predicted-ttft-scorer"
    needs_prefix = True

    def __init__(self, name: str | None = None, *, prefill_tokens_per_second: float = 10_000.0,
                 decode_tokens: float = 8.0, queued_request_tokens: float = 1024.0, rate_smoothing: float = 0.2,
                 min_rate_sample_tokens: float = 256.0, per_pod_rate: bool = False, chars_per_token: int = CHARS_PER_TOKEN,
                 observer: PredictionObserver | None = None) -> None:
        super().__init__(name)
        if prefill_tokens_per_second <= 0 or queued_request_tokens <= 0 or chars_per_token <= 0:
            raise ValueError("prefillTokensPerSecond and queuedRequestTokens must be positive")
        if decode_tokens < 0 or not 0 < rate_smoothing <= 1 or min_rate_sample_tokens < 0:
            raise ValueError("decodeTokens >= 0, rateSmoothing within (0, 1], minRateSampleTokens >= 0")
        self.prior_rate = prefill_tokens_per_second
        self.decode_tokens = decode_tokens
        self.rate_smoothing = rate_smoothing
        self.min_rate_sample_tokens = min_rate_sample_tokens
        self.chars_per_token = chars_per_token
        self.mean_uncached = queued_request_tokens  # tokens a queued request will need (learned from our picks)
        # Pods of one pool run the same model on the same hardware: by default they share one learned rate, so
        # one pod's noisy samples do not make it look faster than its twins (and draw their traffic).
        self.per_pod_rate = per_pod_rate
        self.pool_rate = prefill_tokens_per_second
        self.observer = observer
        self._pods: dict[str, _Pod] = {}

    def _pod(self, endpoint: Endpoint) -> _Pod:
        pod = self._pods.get(endpoint.address)
        if pod is None:
            pod = self._pods[endpoint.address] = _Pod(self.prior_rate)
        m = endpoint.metrics
        if m.updated_at != pod.seen_at:
            self._learn_rate(pod, m.prefill_tokens, m.prefill_seconds)
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

    def _learn_rate(self, pod: _Pod, tokens: float, seconds: float) -> None:
        """Fold the prefill work finished since the last sample into the pod's rate. Increments smaller than
        `min_rate_sample_tokens` accumulate into a later sample; a counter that went back (the pod restarted)
        starts over."""
        if pod.seen_tokens < 0 or tokens < pod.seen_tokens or seconds < pod.seen_seconds:
            pod.seen_tokens, pod.seen_seconds = tokens, seconds
            return
        d_tokens, d_seconds = tokens - pod.seen_tokens, seconds - pod.seen_seconds
        if d_tokens >= self.min_rate_sample_tokens and d_seconds > 0:
            sample = d_tokens / d_seconds
            pod.rate += self.rate_smoothing * (sample - pod.rate)
            self.pool_rate += self.rate_smoothing * (sample - self.pool_rate)
            pod.seen_tokens, pod.seen_seconds = tokens, seconds

    def _prompt_tokens(self, ctx: SchedulingContext) -> float:
        return len(ctx.request.prompt_text) / self.chars_per_token

    def predict(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[Prediction]:
        """Each candidate's predicted TTFT (needs `ctx.matched` aligned with `candidates`)."""
        prompt = self._prompt_tokens(ctx)
        block_tokens = ctx.block_chars / self.chars_per_token
        matched = ctx.matched or [0] * len(candidates)
        return [self._predict_one(e, self._pod(e), prompt - blocks * block_tokens, ctx.now)
                for e, blocks in zip(candidates, matched, strict=True)]

    def _predict_one(self, e: Endpoint, pod: _Pod, uncached: float, now: float) -> Prediction:
        if uncached < 0.0:
            uncached = 0.0
        queued = e.metrics.waiting * self.mean_uncached
        rate = pod.rate if self.per_pod_rate else self.pool_rate
        wait = pod.backlog_at(now, rate)
        if queued > wait:
            wait = queued
        running = e.metrics.running if e.metrics.running > e.in_flight else e.in_flight
        decode = running * self.decode_tokens
        return Prediction((wait + uncached + decode) / rate, wait, uncached, decode, rate)

    def _uncached(self, ctx: SchedulingContext, endpoint: Endpoint) -> float:
        """This request's prompt tokens the index does not place on `endpoint`."""
        uncached = self._prompt_tokens(ctx) - ctx.matches.get(endpoint.address, 0) * ctx.block_chars / self.chars_per_token
        return uncached if uncached > 0.0 else 0.0

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
        pod = self._pod(endpoint)
        uncached = self._uncached(ctx, endpoint)
        if self.observer is not None:  # what we expected of this pick, before it joins the pod's queue
            pod.predicted_sum += self._predict_one(endpoint, pod, uncached, now).seconds
            pod.predicted_n += 1
        self._add(pod, uncached, now)

    def on_peer_picked(self, pick: PeerPick, now: float) -> None:
        """A peer's pick carries no match length: count its whole prompt (an overestimate the drain corrects)."""
        pod = self._pods.get(pick.address)
        if pod is None:
            pod = self._pods[pick.address] = _Pod(self.prior_rate)
        self._add(pod, pick.prompt_chars / self.chars_per_token, now)

    def _add(self, pod: _Pod, tokens: float, now: float) -> None:
        if now < pod.at:  # a peer's pick may be a moment older than our last
            now = pod.at
        pod.backlog = pod.backlog_at(now, pod.rate if self.per_pod_rate else self.pool_rate) + tokens
        pod.at = now
        self.mean_uncached += 0.05 * (tokens - self.mean_uncached)

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        self._pods.pop(endpoint.address, None)


class PredictedTTFTParams(Section):
    prefill_tokens_per_second: float = Field(10_000.0, gt=0)  # the prior, until the pod's own figures arrive
    decode_tokens: float = Field(8.0, ge=0)  # prefill tokens' worth of time one running request adds
    queued_request_tokens: float = Field(1024.0, gt=0)  # prior for a queued request's uncached prompt
    rate_smoothing: float = Field(0.2, gt=0, le=1)
    min_rate_sample_tokens: float = Field(256.0, ge=0)
    per_pod_rate: bool = False  # learn each pod's rate apart (a pool of unlike pods) instead of one for all


def _predicted(name: str, p: PredictedTTFTParams, deps: PluginDeps) -> Plugin:
    kwargs: dict[str, Any] = p.model_dump()
    return PredictedTTFTScorer(name, **kwargs, chars_per_token=deps.chars_per_token, observer=deps.observer)


FACTORIES: tuple[PluginFactory[Any], ...] = (
    PluginFactory(PredictedTTFTScorer.type_name, PredictedTTFTParams, _predicted),
)
