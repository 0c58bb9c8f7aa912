"""One OpenTelemetry span per decision and per refusal (`--otlp-endpoint`), through the DecisionRecorder
interface: the request, where it went, what the index matched; or the refusal's status and code."""

from __future__ import annotations

import time

from picker.core.requests import InferenceRequest, RequestError
from picker.routing.decision import Decision
from picker.routing.lifecycle import PluginDeps, RequestPlugin
from picker.routing.observers import DecisionRecorder


def _attributes(request: InferenceRequest) -> dict[str, str | int | float]:
    return {"picker.request_id": request.request_id, "gen_ai.request.model": request.model,
            "picker.priority": request.priority, "http.route": request.path.split("?", 1)[0]}


class DecisionTraces(RequestPlugin):
    name = "decision-traces"

    def __init__(self, recorder: DecisionRecorder) -> None:
        self.recorder = recorder

    def placed(self, decision: Decision, body: bytes) -> None:
        result = decision.result
        now = time.time_ns()  # the span starts when the request was complete: its decision time before now
        self.recorder.record(now - int(decision.decided_s * 1e9), now, {
            **_attributes(decision.request), "picker.destination": decision.destination,
            "picker.profile": result.profile if result else "",
            "picker.prefix_blocks": result.prefix_blocks if result else 0,
            "picker.prefix_matched_blocks": result.prefix_matched_blocks if result else 0})

    def refused(self, request: InferenceRequest, err: RequestError, took_s: float) -> None:
        now = time.time_ns()
        self.recorder.record(now - int(took_s * 1e9), now, {**_attributes(request), "picker.error.status": err.status,
                                                       "picker.error.code": err.code})


def factory(deps: PluginDeps) -> DecisionTraces | None:
    """With a tracer (`--otlp-endpoint`)."""
    return DecisionTraces(deps.tracer) if deps.tracer is not None else None
