"""The Grafana dashboard only queries series the picker really exports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from pathlib import Path

from prometheus_client import generate_latest

from picker.endpoints.state import Endpoint, EndpointMetrics
from picker.flowcontrol.controller import FlowController, FlowSettings
from picker.observability import PickerMetrics, ResponseTrace
from picker.prefix.shared import SyncStats
from picker.requests import InferenceRequest, Usage
from picker.saturation import SaturationThresholds

DASHBOARD = Path(__file__).resolve().parents[1] / "manifests" / "grafana" / "picker-dashboard.json"
METRIC = re.compile(r"\b(?:inference|picker)_[a-z0-9_]+\b")


def exported_series() -> set[str]:
    """Every series name a picker exposes once it has routed, refused, scraped a pod, synced an index and compared
    a predicted TTFT with a measured one."""
    metrics = PickerMetrics("pool")
    metrics.watch_index_sync(SyncStats())
    request = InferenceRequest(request_id="r", model="m", target_model="m-rewritten", stream=True)
    pod = Endpoint.from_address("10.0.0.1:8000")
    metrics.observe_routed(request, 0.001, 1, 2, pod, 64)
    metrics.observe_refused(request, "saturated")
    metrics.observe_refused(request, "no_endpoints", scheduling=True)
    response = ResponseTrace(started_at=0.0, itl=metrics.itl_observer(request))
    for at in (0.1, 0.2, 0.3):
        response.on_chunk(at, 100, 0.0001)
    metrics.observe_finished(request, 1.0, Usage(100, 10, 50), response)
    metrics.observe_plugin("Scorer", "queue-scorer", "queue-scorer", 0.00001)
    metrics.observe_processing(0.001)
    metrics.index_size_value.set(1)
    metrics.stream_errors.labels("malformed").inc()
    metrics.observe_pool([pod])
    metrics.observe_scrape(pod, True)
    metrics.observe_prediction(pod, 0.1, 0.12)
    full = Endpoint.from_address("10.0.0.2:8000")
    full.metrics = EndpointMetrics(waiting=50, updated_at=0.0)
    flow = FlowController(FlowSettings(), SaturationThresholds(stale=1e9), lambda: [full], clock=lambda: 0.0,
                          observer=metrics)
    metrics.watch_flow(flow)
    text = asyncio.run(_scraped_while_one_waits(flow, metrics))
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


async def _scraped_while_one_waits(flow: FlowController, metrics: PickerMetrics) -> str:
    waiting = asyncio.create_task(flow.admit(InferenceRequest(request_id="q", model="m")))
    await asyncio.sleep(0)  # it queues: the pool has no room
    queued = generate_latest(metrics.registry).decode()
    waiting.cancel()  # its client leaves: an outcome, and the time it waited
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    return queued + generate_latest(metrics.registry).decode()


def test_every_query_names_an_exported_series() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    exprs.append(dashboard["templating"]["list"][1]["definition"])
    assert len(exprs) > 15
    exported = exported_series()
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    assert used and used <= exported, sorted(used - exported)
    # Every picker_* and GIE family the picker exports has a panel (each also exported under the reference's
    # current llm_d_epp_* name: the same data, dashboards may use either).
    families = {re.sub(r"_(bucket|sum|count|total|created)$", "", n) for n in exported if METRIC.fullmatch(n)}
    shown = {re.sub(r"_(bucket|sum|count|total|created)$", "", n) for n in used}
    assert families <= shown, sorted(families - shown)


def test_panels_do_not_overlap() -> None:
    cells: set[tuple[int, int]] = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        g = panel["gridPos"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, panel["title"]
        cells |= area
