"""Which pods serve which model: a pool may serve several base models (and LoRA adapters on top of them), so a
request goes only to pods that serve the model it names.

What a pod serves comes from its own metrics, the `model_name` label of its series (its base model or models) and
the adapters `vllm:lora_requests_info` lists as running or waiting, and from its `GET /v1/models` listing (every
adapter it has loaded, idle ones too; `picker.endpoints.model_listing`). A pod that reports no model yet (never
scraped, or an engine that does not label its series) is not ruled out: nothing is known against it. An adapter
configured in `scheduling.models.adapters` that no pod runs yet may be loaded by any pod with LoRA slots
(`max_lora` > 0). A model nothing serves is a 404 `model_not_found` from the picker, as vLLM itself would answer.
`GET /v1/models` through the gateway is answered by the picker with the union of what the pool serves (a pod
would list only its own models).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from picker.core.requests import RequestError
from picker.endpoints.state import Endpoint


def serves(endpoint: Endpoint, model: str) -> bool:
    m = endpoint.metrics
    return model in m.models or model in m.running_loras or model in m.waiting_loras or model in endpoint.listing()


def reports(endpoint: Endpoint) -> bool:
    """Whether the pod has told us anything of what it serves."""
    return bool(endpoint.metrics.models or endpoint.listing())


_NONE: frozenset[str] = frozenset()


def _all_may_serve(model: str, candidates: Sequence[Endpoint]) -> bool:
    """`all(not reports(e) or serves(e, model) for e in candidates)` in one loop without calls: it runs on every
    request over every candidate pod."""
    for e in candidates:
        m = e.metrics
        models = m.models
        if model in models or model in m.running_loras or model in m.waiting_loras:
            continue
        listed = e.listed_models if e.listed_for == models else _NONE
        if model in listed or not (models or listed):
            continue
        return False
    return True


class ModelServing:
    def __init__(self, adapters: Iterable[str] = ()) -> None:
        self.adapters = frozenset(adapters)

    def pods_for(self, model: str, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
        """The candidates that serve `model` (or may: nothing known against them); RequestError 404 for none."""
        if _all_may_serve(model, candidates):
            return candidates  # every pod serves it, or reports nothing against it (a single-model pool, unscraped)
        out = [e for e in candidates if not reports(e) or serves(e, model)]
        if out:
            return out
        if model in self.adapters:
            loadable = [e for e in candidates if e.metrics.max_lora > 0]
            if loadable:
                return loadable
        raise RequestError(404, "model_not_found", f"no ready pod serves model {model!r} (served: "
                           f"{', '.join(self.served(candidates)) or 'none reported'})")

    def listing(self, endpoints: Sequence[Endpoint]) -> bytes | None:
        """The body of `GET /v1/models` for the pool; None while no pod reports its models (a pod answers)."""
        if not any(reports(e) for e in endpoints):
            return None
        return models_listing(self.served(endpoints))

    def served(self, endpoints: Iterable[Endpoint]) -> list[str]:
        """Every model and adapter the pods report, and the configured adapters: what `/v1/models` lists."""
        names: set[str] = set(self.adapters)
        for e in endpoints:
            m = e.metrics
            names.update(m.models, m.running_loras, m.waiting_loras, e.listing())
        return sorted(names)


def models_listing(models: list[str]) -> bytes:
    """`GET /v1/models` as OpenAI shapes it, for the models a pool serves."""
    return json.dumps({"object": "list", "data": [
        {"id": name, "object": "model", "owned_by": "picker"} for name in models]}).encode()
