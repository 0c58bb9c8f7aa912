"""Prefill/decode disaggregation's part of a request's life: the prefill pod the scheduler chose is busy with the
prompt until the response begins (its in-flight count), and the decode pod's sidecar learns it from
`x-prefiller-host-port`, a header only the picker may set (a client's is removed); when that pod is one rank of a
data-parallel server, its rank goes in `x-prefiller-data-parallel-rank` (the sidecar's prefill leg carries it to
the server as `x-data-parallel-rank`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from picker.core import headers as names
from picker.routing.decision import Decision
from picker.routing.lifecycle import PluginDeps, RequestPlugin


class Disaggregation(RequestPlugin):
    name = "disaggregation"
    hears_response_start = True  # the prefill is done when the response begins, not when it ends

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock

    def placed(self, decision: Decision, body: bytes) -> None:
        prefill = decision.prefill
        if prefill is not None:
            prefill.start_request(decision.tokens, self.clock())
            decision.keep(self.name, prefill)
        decision.own_header(names.PREFILLER, prefill.destination if prefill is not None else None)
        decision.own_header(names.PREFILLER_RANK, str(prefill.rank) if prefill is not None and prefill.rank >= 0
                            else None)

    def response_started(self, decision: Decision, headers: Mapping[str, str], body_follows: bool) -> None:
        self._prefilled(decision)

    def finished(self, decision: Decision) -> None:
        self._prefilled(decision)

    def _prefilled(self, decision: Decision) -> None:
        prefill = decision.kept(self.name)
        if prefill is not None:
            decision.keep(self.name, None)
            prefill.finish_request(decision.tokens)


def factory(deps: PluginDeps) -> Disaggregation | None:
    """With a scheduler that may disaggregate."""
    return Disaggregation(deps.clock) if deps.scheduler.may_disaggregate else None
