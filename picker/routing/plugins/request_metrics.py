"""The request series (picker/serving/metrics, through the RequestObserver interface): each decision, its time,
each refusal, and, when Envoy shows the picker the response body, the usage the pod reported, the response's
chunks (inter-token latency) and the prefix hit the index expected against the one the pod reported."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from picker.core import headers as names
from picker.core.requests import InferenceRequest, RequestError
from picker.core.usage import UsageReader
from picker.routing.decision import Decision
from picker.routing.lifecycle import PluginDeps, RequestPlugin
from picker.routing.observers import RequestObserver, ResponseTrace


class RequestMetrics(RequestPlugin):
    name = "request-metrics"

    def __init__(self, observer: RequestObserver, clock: Callable[[], float]) -> None:
        self.observer = observer
        self.clock = clock

    def placed(self, decision: Decision, body: bytes) -> None:
        result = decision.result
        if result is None:
            return
        ctx = result.context
        self.observer.observe_routed(decision.request, decision.scheduled_s, result.prefix_matched_blocks,
                                     result.prefix_blocks, decision.endpoint,
                                     ctx.block_chars if ctx is not None else 0, result.disaggregation)
        if decision.decided_s:
            self.observer.observe_processing(decision.decided_s)

    def refused(self, request: InferenceRequest, err: RequestError, took_s: float) -> None:
        self.observer.observe_refused(request, err.code, scheduling=err.code == "no_endpoints")

    def response_started(self, decision: Decision, headers: Mapping[str, str], body_follows: bool) -> None:
        if body_follows:
            decision.keep(self.name, (UsageReader(headers.get(names.CONTENT_TYPE, "")),
                                      ResponseTrace(decision.started_at, self.observer.itl_observer(decision.request))))

    def response_chunk(self, decision: Decision, chunk: bytes, end: bool, began: float) -> bytes:
        reading: tuple[UsageReader, ResponseTrace] | None = decision.kept(self.name)
        if reading is not None:
            usage, trace = reading
            usage.feed(chunk, end)
            trace.on_chunk(self.clock(), len(chunk), time.perf_counter() - began)
        return chunk

    def finished(self, decision: Decision) -> None:
        reading: tuple[UsageReader, ResponseTrace] | None = decision.kept(self.name)
        usage = reading[0].usage if reading is not None else None
        self.observer.observe_finished(decision.request, self.clock() - decision.started_at, usage,
                                       reading[1] if reading is not None else None)
        if usage is not None and usage.prompt_tokens:
            self.observer.observe_prefix_hit(decision.endpoint, min(decision.expected_cached, usage.prompt_tokens),
                                             usage.cached_tokens)


def factory(deps: PluginDeps) -> RequestMetrics | None:
    """Where something observes the requests (`picker serve`'s metrics)."""
    return RequestMetrics(deps.metrics, deps.clock) if deps.metrics is not None else None
