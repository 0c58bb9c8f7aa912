"""Request life-cycle plugins: the features that act on a routed request at the fixed points of its life.

After the admission gate lets it through, a request is *resolved* (what the pod will be asked for, such as the
model), *placed* (scheduled and accounted for: a plugin may change what the pod gets, its body or headers), its
response *starts* (its headers came), its response body passes *chunk by chunk* (a plugin may change a chunk),
and it *ends*, however it ends, once; a request refused on the way is *refused*. The director calls every plugin
at each point, in the table's order (picker/routing/plugins), and knows none of them; the servicer only serialises
what they decided. Per-request state travels in the Decision (`keep`/`kept`), never in a plugin's fields: one
plugin object serves every request. A feature that changes the request or reads the response is one new module
and one line of the table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from picker.core.model_rewrite import ModelRewrites
from picker.core.requests import InferenceRequest, RequestError
from picker.routing.decision import Decision
from picker.routing.observers import DecisionRecorder, RequestObserver
from picker.scheduling.types import Scheduler


class RequestPlugin:
    """A plugin overrides the points it acts at; the others do nothing."""

    name = ""  # its name in the table
    hears_response_start = False  # it acts when the response starts: Envoy must send the response's headers

    def resolve(self, request: InferenceRequest) -> None:
        """Before candidates are looked at: decide what the pod will be asked for."""

    def placed(self, decision: Decision, body: bytes) -> None:
        """Scheduled and accounted for: change what the pod gets (`decision.body`, `set_header`, `remove_header`;
        `body`: the client's, empty when the caller has none, as a benchmark's)."""

    def refused(self, request: InferenceRequest, err: RequestError, took_s: float) -> None:
        """Refused (`took_s`: the picker's time on it until then, 0 when not known)."""

    def response_started(self, decision: Decision, headers: Mapping[str, str], body_follows: bool) -> None:
        """The response's headers came (`headers` only when its body will be shown: `body_follows`)."""

    def response_chunk(self, decision: Decision, chunk: bytes, end: bool, began: float) -> bytes:
        """A chunk of the response body (`end`: the last), as the plugins before this one left it; returns it, or
        what replaces it. `began`: perf_counter when the director took the chunk (what handling it costs)."""
        return chunk

    def finished(self, decision: Decision) -> None:
        """The request ended (response end or stream closed), called once."""


@dataclass(frozen=True)
class PluginDeps:
    """What the table's factories may build a plugin from: the serving assembly's (or a benchmark's) parts."""

    scheduler: Scheduler
    clock: Callable[[], float]
    rewrites: ModelRewrites = field(default_factory=ModelRewrites)
    metrics: RequestObserver | None = None
    tracer: DecisionRecorder | None = None


# A factory builds its plugin from the deps, or returns None when nothing configured calls for it.
PluginFactory = Callable[[PluginDeps], RequestPlugin | None]
