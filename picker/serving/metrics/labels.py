"""Label values the picker's series may carry: bounded, so a client cannot grow /metrics with made-up names."""

from __future__ import annotations

from collections.abc import Iterable

from picker.core.requests import InferenceRequest
from picker.endpoints.state import Endpoint

OTHER_MODEL = "other"
LATENCY_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30,
                   45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600)
SCHEDULER_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0)
SIZE_BUCKETS = tuple(float(2**k) for k in range(6, 25, 2))  # 64 B .. 16 MiB
TOKEN_TIME_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072)


class ModelLabels:
    """Which model names may become metric label values: those the pool's pods serve (their series'
    `model_name`, their loaded LoRA adapters) and those configured (`scheduling.models`); any other name a client
    sends counts as "other". A client must not be able to grow /metrics (and the picker's memory) with made-up
    model names; `limit` caps the set even if pods report thousands of adapters."""

    __slots__ = ("configured", "limit", "_allowed")

    def __init__(self, configured: Iterable[str] = (), limit: int = 512) -> None:
        self.configured = frozenset(configured)
        self.limit = limit
        self._allowed = self.configured | {""}  # "": refused before its model was read

    def learn(self, endpoints: Iterable[Endpoint]) -> None:
        """Add what the latest scrapes report (called with every pool refresh). Never removes: a label a routed
        request was counted under stays the one its end is counted under."""
        allowed = set(self._allowed)
        for endpoint in endpoints:
            m = endpoint.metrics
            for name in (*m.models, *m.running_loras, *m.waiting_loras):
                if len(allowed) >= self.limit:
                    break
                allowed.add(name)
        if len(allowed) != len(self._allowed):
            self._allowed = frozenset(allowed)

    def label(self, model: str) -> str:
        return model if model in self._allowed else OTHER_MODEL


# The reference picker's labels of request series; fairness_id is the flow-control tenant the request names
# (x-llm-d-inference-fairness-id), empty when it names none.
REQUEST_LABELS = ("model_name", "target_model_name", "fairness_id", "priority")
FLOW_LABELS = ("fairness_id", "priority", "inference_pool", "model_name", "target_model_name")
NO_FAIRNESS_ID = ""


class FirstSeenLabels:
    """Label values a client chooses (fairness ids), bounded as the reference bounds them: the first `limit`
    distinct values are kept, any later one counts as "other"."""

    __slots__ = ("limit", "_seen")

    def __init__(self, limit: int = 1000) -> None:
        self.limit = limit
        self._seen: set[str] = {""}

    def label(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) < self.limit:
            self._seen.add(value)
            return value
        return OTHER_MODEL



class RequestLabels:
    """A request's bounded label values, shared by the request and flow-control series."""

    __slots__ = ("models", "fairness")

    def __init__(self, models: ModelLabels, fairness: FirstSeenLabels) -> None:
        self.models = models
        self.fairness = fairness

    def of(self, request: InferenceRequest) -> tuple[str, str, str]:
        """model_name, target_model_name, fairness_id of a request, every one bounded."""
        model = self.models.label(request.model)
        return model, self.models.label(request.target_model) if request.target_model else model, \
            self.fairness.label(request.fairness_id or "")
