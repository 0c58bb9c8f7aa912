"""Offered load and capacity: what "80 % load" means, and the smallest fleet that holds a TTFT target.

Load is defined cache-blind, so it means the same for every strategy: `load = rate / capacity`, where
capacity = pods / cost and cost is the accelerator time one request needs when nothing of its prompt is cached:
its whole prefill (tokens x prefill cost + attention) plus its decode steps' marginal cost in a batch (per
sequence + KV reads), from the profile's step-time model. The fixed per-step cost is left out because a busy
pod shares it across its batch. Token counts come from a sample of the workload replayed in fast mode (so
multi-turn histories include real answers). At load 1.0 a cache-blind fleet is saturated; prefix hits are the
headroom a router can win.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from picker_lab.bench.fast import FastConfig, run_fast
from picker_lab.bench.trace import Trace
from picker_lab.bench.workloads import FleetSpec, generate
from picker_lab.sim.profiles import Profile


def saturating(trace: Trace) -> Trace:
    """The same requests, all sent at time 0 and follow-ups sent at once (a closed, saturating batch)."""
    reqs = tuple(replace(r, at=0.0) for r in trace.requests)
    return Trace(trace.workload, trace.seed, trace.rate, reqs, dict(trace.params))


def request_cost(profile: Profile, prompt: int, output: int) -> float:
    """Cache-blind accelerator seconds of one request (prefill + marginal decode cost)."""
    prefill = prompt * profile.prefill_token_s + profile.prefill_attn_s * prompt * (prompt + 1) / 2
    decode = output * (profile.decode_seq_s + profile.decode_ctx_token_s * (prompt + output / 2))
    return prefill + decode


def cost_per_request(workload: str, fleet: FleetSpec, seed: int, params: dict[str, Any] | None = None,
                     sample: int = 240) -> float:
    """Mean cache-blind accelerator seconds per request of this workload (token counts from a sample run)."""
    trace = saturating(generate(workload, sample, 1.0, seed + 7919, fleet, **(params or {})))
    res = run_fast(trace, "round-robin", FastConfig(fleet.profile, 1, seed=seed, prefix_caching=False))
    costs = [request_cost(fleet.profile, p, o) for p, o, s in zip(res.prompt_tokens, res.output_tokens, res.status,
                                                                strict=True) if s == 0]
    if not costs:
        raise RuntimeError(f"calibration of {workload} completed no request")
    return sum(costs) / len(costs)


def rate_for_load(load: float, pods: int, cost: float) -> float:
    """Requests/s that make `load` of the cache-blind capacity of `pods` pods."""
    return load * pods / cost


def smallest_fleet(measure: Callable[[int], float], target: float, lo: int = 1, hi: int = 64) -> int | None:
    """Fewest pods whose p95 TTFT (from `measure(pods)`) is <= target, by bisection (p95 falls with pods);
    None when even `hi` pods miss it."""
    if measure(hi) > target:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if measure(mid) <= target:
            hi = mid
        else:
            lo = mid + 1
    return lo
