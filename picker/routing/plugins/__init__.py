"""The request life-cycle plugins (picker/routing/lifecycle.py), in the order they act: a table of name -> factory.
`build` makes the plugins a configuration calls for (each factory decides from the deps). A new feature is a module
here and a line of the table."""

from __future__ import annotations

from picker.routing.lifecycle import PluginDeps, PluginFactory, RequestPlugin
from picker.routing.plugins import (
    data_parallel,
    decision_traces,
    disaggregation,
    model_rewrite,
    request_metrics,
)

REQUEST_PLUGINS: dict[str, PluginFactory] = {
    "model-rewrite": model_rewrite.factory,  # first: the metrics and traces see the pod's body and model
    "disaggregation": disaggregation.factory,
    "data-parallel": data_parallel.factory,
    "request-metrics": request_metrics.factory,
    "decision-traces": decision_traces.factory,
}


def build(deps: PluginDeps, table: dict[str, PluginFactory] | None = None) -> list[RequestPlugin]:
    """Every plugin of the table (REQUEST_PLUGINS unless given) the deps call for, in table order."""
    plugins = (factory(deps) for factory in (REQUEST_PLUGINS if table is None else table).values())
    return [p for p in plugins if p is not None]
