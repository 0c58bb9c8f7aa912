"""Live mode's routers as they are deployed: `picker@2` is two `picker serve` replicas behind their Envoy sharing a
prefix index on a Valkey; a bad replica count is refused before anything starts."""

from __future__ import annotations

import json
import urllib.request

import pytest

from picker_lab.bench.live import LiveSpec, router_cpu, start_router
from picker_lab.supervisor import process_scope, start_backends, start_sim


def test_picker_replicas_share_a_valkey_behind_their_envoy() -> None:
    with process_scope("live-replicas") as (logdir, started):
        pods = start_sim(2, logdir, model="tiny", extra=["--profile", "tiny-cpu"])
        started.append(pods.process)
        router = start_router("picker@2", LiveSpec(), pods.addresses, [f"http://{a}" for a in pods.addresses],
                              logdir)
        procs, url = router.processes, router.url
        started.extend(procs)
        names = sorted(p.name for p in procs)
        assert names[:2] == ["envoy-picker-picker", "picker-picker-0"] and "valkey-picker" in names, names
        for i in range(8):
            body = json.dumps({"model": "tiny", "prompt": f"{i} shared opening of a prompt", "max_tokens": 2})
            request = urllib.request.Request(url + "/v1/completions", data=body.encode(),
                                             headers={"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == 200
        pickers = [p for p in procs if p.name.startswith("picker-picker-")]
        assert len(pickers) == 2 and all(p.alive() for p in pickers)
        assert all("--redis-url" in " ".join(p.proc.args) for p in pickers)  # type: ignore[arg-type]
        assert router_cpu(procs) > router_cpu(pickers) > 0  # what it routed with, Envoy and Valkey included


def test_a_stateless_router_replicated_shares_nothing() -> None:
    """hash-ring@2: two replicas of a consistent hash agree without any shared state (no Valkey)."""
    with process_scope("live-ring") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        router = start_router("hash-ring@2", LiveSpec(), backends.addresses, [], logdir)
        procs, url = router.processes, router.url
        started.extend(procs)
        assert sorted(p.name for p in procs) == ["envoy-picker-hash-ring", "picker-hash-ring-0", "picker-hash-ring-1"]
        assert url.startswith("http://127.0.0.1:")


def test_a_bad_replica_count_is_refused_before_anything_starts() -> None:
    with process_scope("live-bad") as (logdir, started):
        backends = start_backends(1, logdir)
        started.append(backends.process)
        with pytest.raises(RuntimeError, match="the count after @"):
            start_router("smg@0", LiveSpec(), backends.addresses, [], logdir)


def test_the_live_report_shows_each_routers_own_cpu() -> None:
    from picker_lab.bench.report import live_markdown

    lines = live_markdown({"strategies": {}, "router_cpu": {"smg-mesh@4": {"cpu_s": 12.5, "wall_s": 50.0,
                                                                           "processes": 5}}})
    assert "| smg-mesh@4 | 5 | 12.5 | 0.250 |" in lines
