"""The Grafana dashboard only queries series the picker really exports, under their current names: it works
with `--metrics-deprecated-names=false`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from pathlib import Path

from prometheus_client import generate_latest

from picker.core.metric_twins import Twin
from picker.core.requests import InferenceRequest, Usage
from picker.endpoints.saturation import SaturationThresholds
from picker.endpoints.shared_load import LoadSyncStats
from picker.endpoints.shared_scrape import SharedScrapes
from picker.endpoints.state import Endpoint, EndpointMetrics
from picker.flowcontrol.controller import FlowController, FlowSettings
from picker.kvevents.relay import RelayStats
from picker.kvevents.subscriber import SubscriberStats
from picker.prefix.precise import PreciseIndex
from picker.prefix.shared import SyncStats
from picker.routing.director import through_gate
from picker.routing.observers import ResponseTrace
from picker.serving.metrics import PickerMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "manifests" / "grafana" / "picker-dashboard.json"
METRIC = re.compile(r"\b(?:llm_d|inference|picker)_[a-z0-9_]+\b")
SUFFIX = re.compile(r"_(bucket|sum|count|total|created)$")  # a family's sample names: the family name + these


def exercised(deprecated_names: bool) -> tuple[PickerMetrics, str]:
    """A picker that has routed, refused, scraped a pod, synced an index, compared a predicted TTFT with a measured
    one, queued a request in flow control and followed a pod's KV events, and its /metrics text."""
    metrics = PickerMetrics("pool", deprecated_names=deprecated_names)
    metrics.watch_index_sync(SyncStats())
    request = InferenceRequest(request_id="r", model="m", target_model="m-rewritten", stream=True)
    pod = Endpoint.from_address("10.0.0.1:8000")
    metrics.requests.observe_routed(request, 0.001, 1, 2, pod, 64)
    metrics.requests.observe_refused(request, "saturated")
    metrics.requests.observe_refused(request, "no_endpoints", scheduling=True)
    response = ResponseTrace(started_at=0.0, itl=metrics.requests.itl_observer(request))
    for at in (0.1, 0.2, 0.3):
        response.on_chunk(at, 100, 0.0001)
    metrics.requests.observe_finished(request, 1.0, Usage(100, 10, 50), response)
    metrics.scheduling.observe_plugin("Scorer", "queue-scorer", "queue-scorer", 0.00001)
    metrics.requests.observe_processing(0.001)
    metrics.scheduling.index_size_value.set(1)
    metrics.streams.stream_failed("malformed")
    metrics.pool.observe_pool([pod])
    metrics.pool.observe_scrape(pod, True)
    metrics.scheduling.observe_prediction(pod, 0.1, 0.12)
    metrics.requests.observe_prefix_hit(pod, 100, 90)
    full = Endpoint.from_address("10.0.0.2:8000")
    full.metrics = EndpointMetrics(waiting=50, updated_at=0.0)
    flow = FlowController(FlowSettings(), SaturationThresholds(stale=1e9), lambda: [full], clock=lambda: 0.0)
    flow.observer = metrics.watch_flow(flow)
    precise = PreciseIndex()
    precise.apply(pod.address, [], now=0.0)
    events = SubscriberStats(by_pod={pod.address: 1})
    metrics.watch_kv_events(events, precise, clock=lambda: 1.0)
    metrics.watch_kv_relay(RelayStats(sent=1))
    metrics.watch_load_sync(LoadSyncStats(syncs=1, bytes_sent=10, bytes_received=20, peers=1, connected=True))
    metrics.watch_shared_scrapes(SharedScrapes("redis://127.0.0.1:1/0", "pool"))  # never called: counts at 0
    return metrics, asyncio.run(_scraped_while_one_waits(flow, metrics))


def series_of(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def exported_series(deprecated_names: bool = False) -> set[str]:
    """Every series name such a picker exposes (by default as with `--metrics-deprecated-names=false`)."""
    return series_of(exercised(deprecated_names)[1])


def declared_twins() -> list[Twin]:
    """Every deprecated twin a picker declares (PickerMetrics' and flow control's), as registered with its registry."""
    metrics, _ = exercised(deprecated_names=True)
    return metrics.twins


def family_of(twin: Twin) -> str:
    """The current family a twin copies."""
    return twin.family or next(iter(twin.source.collect())).name


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    exprs.append(dashboard["templating"]["list"][1]["definition"])
    return exprs


async def _scraped_while_one_waits(flow: FlowController, metrics: PickerMetrics) -> str:
    request = InferenceRequest(request_id="q", model="m")
    waiting = asyncio.create_task(through_gate(flow, lambda go: flow.offer(request, (), go), flow.clock))
    await asyncio.sleep(0)  # it queues: the pool has no room
    queued = generate_latest(metrics.registry).decode()
    waiting.cancel()  # its client leaves: an outcome, and the time it waited
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    return queued + generate_latest(metrics.registry).decode()


def test_every_query_names_a_series_exported_without_the_deprecated_names() -> None:
    exprs = dashboard_exprs()
    assert len(exprs) > 15
    exported = exported_series(deprecated_names=False)
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    assert used and used <= exported, sorted(used - exported)
    # Every picker_* family, and every family GIE named (its twin an inference_* name), has a panel.
    twins = declared_twins()
    families = {SUFFIX.sub("", n) for n in exported if n.startswith("picker_")}
    families |= {family_of(t) for t in twins if t.name.startswith("inference_")}
    shown = {SUFFIX.sub("", n) for n in used}
    assert families <= shown, sorted(families - shown)


def test_no_query_names_a_deprecated_series() -> None:
    twins = declared_twins()
    deprecated = {t.name for t in twins}
    assert any(n.startswith("inference_extension_flow_control_") for n in deprecated)  # flow control's too
    # the twins are every series the deprecated names add, and none is exported without them
    with_twins, without = exported_series(deprecated_names=True), exported_series(deprecated_names=False)
    assert {SUFFIX.sub("", n) for n in with_twins - without} <= deprecated
    assert not {n for n in without if n in deprecated or SUFFIX.sub("", n) in deprecated}
    named = {(n, expr) for expr in dashboard_exprs() for n in METRIC.findall(expr)
             if n in deprecated or SUFFIX.sub("", n) in deprecated}
    assert not named, sorted(named)


def test_panels_do_not_overlap() -> None:
    cells: set[tuple[int, int]] = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        g = panel["gridPos"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, panel["title"]
        cells |= area
