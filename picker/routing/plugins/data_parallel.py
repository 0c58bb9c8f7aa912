"""Data-parallel ranks behind one port: a request routed to a rank (picker.endpoints.pool) goes to its server's
ip:port carrying `x-data-parallel-rank`, which vLLM's API server reads to hand it to that engine instead of
balancing it itself. A client's header of that name is removed whatever the pick: a client steering a rank behind
the picker's back would leave the prefix index wrong about where its prompt is cached."""

from __future__ import annotations

from picker.core import headers as names
from picker.routing.decision import Decision
from picker.routing.lifecycle import PluginDeps, RequestPlugin


class DataParallelRank(RequestPlugin):
    name = "data-parallel"

    def placed(self, decision: Decision, body: bytes) -> None:
        rank = decision.endpoint.rank
        decision.own_header(names.DATA_PARALLEL_RANK, str(rank) if rank >= 0 else None)


def factory(deps: PluginDeps) -> DataParallelRank:
    """Always: which servers have ranks is learned from their metrics as they are read."""
    return DataParallelRank()
