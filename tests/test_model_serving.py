"""Which pods serve which model: only those a request's model is served by, pods that report nothing are not
ruled out, configured adapters may load where LoRA slots exist, and a model nothing serves is 404."""

from __future__ import annotations

import pytest

from picker.core.requests import RequestError
from picker.endpoints.model_serving import ModelServing
from picker.endpoints.state import Endpoint, EndpointMetrics


def pod(i: int, models: tuple[str, ...] = (), loras: tuple[str, ...] = (), max_lora: int = 0) -> Endpoint:
    e = Endpoint.from_address(f"10.0.0.{i}:8000")
    e.metrics = EndpointMetrics(models=frozenset(models), running_loras=frozenset(loras), max_lora=max_lora)
    return e


def test_requests_go_only_to_pods_that_serve_their_model() -> None:
    llama, qwen, qwen_lora = pod(1, ("llama",)), pod(2, ("qwen",)), pod(3, ("qwen",), ("sql-lora",), max_lora=2)
    pool = [llama, qwen, qwen_lora]
    serving = ModelServing()
    assert serving.pods_for("llama", pool) == [llama]
    assert serving.pods_for("qwen", pool) == [qwen, qwen_lora]
    assert serving.pods_for("sql-lora", pool) == [qwen_lora]
    with pytest.raises(RequestError) as missing:
        serving.pods_for("mistral", pool)
    assert (missing.value.status, missing.value.code) == (404, "model_not_found")
    assert "llama, qwen, sql-lora" in missing.value.message
    assert serving.served(pool) == ["llama", "qwen", "sql-lora"]


def test_pods_that_report_nothing_are_not_ruled_out() -> None:
    unscraped, llama = pod(1), pod(2, ("llama",))
    serving = ModelServing()
    nobody = [unscraped, pod(3)]
    assert serving.pods_for("anything", nobody) is nobody  # no pod reports models: a single-model pool
    both = [unscraped, llama]
    assert serving.pods_for("llama", both) is both  # nothing known against either: the list as it is
    assert serving.pods_for("qwen", both) == [unscraped]


def test_a_configured_adapter_may_load_where_lora_slots_are() -> None:
    base, lora_ready = pod(1, ("llama",)), pod(2, ("llama",), max_lora=4)
    assert ModelServing(adapters=["new-adapter"]).pods_for("new-adapter", [base, lora_ready]) == [lora_ready]
    with pytest.raises(RequestError):
        ModelServing().pods_for("new-adapter", [base, lora_ready])  # not configured: nothing says it exists
    assert ModelServing(adapters=["new-adapter"]).served([base]) == ["llama", "new-adapter"]


def test_the_models_listing_is_the_pools_union_once_pods_report_models() -> None:
    import json
    assert ModelServing().listing([pod(1), pod(2)]) is None  # nothing reported: a pod answers /v1/models
    listing = ModelServing(adapters=["later"]).listing([pod(1, ("llama",)), pod(2, ("qwen",), ("sql",))])
    assert listing is not None
    body = json.loads(listing)
    assert body["object"] == "list"
    assert [(m["id"], m["object"]) for m in body["data"]] == [
        ("later", "model"), ("llama", "model"), ("qwen", "model"), ("sql", "model")]


def test_an_idle_adapter_a_pod_lists_goes_to_that_pod_and_a_swapped_pod_is_not_believed() -> None:
    plain, loaded = pod(1, ("llama",), max_lora=4), pod(2, ("llama",), max_lora=4)
    loaded.listed_models, loaded.listed_for = frozenset({"llama", "chat-lora"}), loaded.metrics.models
    serving = ModelServing(adapters=["chat-lora"])
    assert serving.pods_for("chat-lora", [plain, loaded]) == [loaded]  # loaded, idle: not in its metrics
    assert serving.served([plain, loaded]) == ["chat-lora", "llama"]
    loaded.metrics = EndpointMetrics(models=frozenset({"qwen"}), max_lora=4, updated_at=0.0)  # swapped
    assert serving.pods_for("chat-lora", [plain, loaded]) == [plain, loaded]  # loadable anywhere again
    assert loaded.listing() == frozenset()


def test_an_alias_the_pod_lists_is_served() -> None:
    """vLLM labels its metrics with the first --served-model-name only; the listing has every name."""
    aliased = pod(1, ("llama",))
    aliased.listed_models, aliased.listed_for = frozenset({"llama", "llama-latest"}), aliased.metrics.models
    assert ModelServing().pods_for("llama-latest", [aliased, pod(2, ("qwen",))]) == [aliased]
