"""The real-engine benchmark's report, rendered from a run's section (`picker_lab.bench.real.run_real`, or a kept
`real.json` re-read): the markdown and the TTFT plot."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from picker.core.distribution import lab_install_hint
from picker_lab.bench import vllm_engine as engine
from picker_lab.bench.real import TTFT_COLUMN, RealSpec
from picker_lab.bench.real_analysis import (
    busier_pick_lines,
    cross_pod_lines,
    first_placement_lines,
    paired_ratio_lines,
    phase_lines,
    routing_cost_lines,
    where_ttft_goes,
)
from picker_lab.bench.real_mirror import MIRROR_OVERSHOOT, SMALL_COLD_TTFT_MS, mirror_overshoots


def servers_text(section: dict[str, Any]) -> str:
    """How the runs got their servers (fresh each time, or shared, settled and emptied between runs) and traces."""
    spec = section["spec"]
    if not spec.get("reuse_servers"):
        text = "Fresh servers for every run"
    else:
        text = "The same servers for every run, their prefix caches emptied between runs"
        settling = section.get("settling_ttft_ms")
        if settling:
            text += (f", after {len(settling)} unmeasured passes of the trace through round-robin (TTFT mean "
                     f"{', '.join(f'{m:.0f}' for m in settling)} ms)")
    if spec.get("seed_per_repeat"):
        first = spec.get("seed", RealSpec.seed)
        return text + (f"; each repeat its own trace (seeds {first}-{first + spec['repeats'] - 1}), so the hash "
                       "routers' placement is thrown anew as with fresh servers")
    return text + "; every repeat the same trace"


def report(section: dict[str, Any]) -> str:
    spec = section["spec"]
    m = section["medians"]
    tpw = section["calibration"].get("tokens_per_word", math.nan)
    model = spec.get("model", RealSpec.model)  # runs recorded before the shape was a choice ran the small one
    lines = [
        f"# Routers on real vLLM servers: workload `{spec.get('workload', 'uniform')}`",
        "",
        f"{spec['servers']} vLLM {engine.VLLM_VERSION} CPU servers ({model} random-weight Llama, local tokenizer, "
        f"prefix caching, block {spec['block_size']}, {spec['num_blocks']} KV blocks each, one core per engine), "
        f"Envoy in front. Workload: {workload_text(spec)} ({spec['requests']} requests, "
        f"{tpw:.2f} tokens per word). {servers_text(section)}; medians of {spec['repeats']} repeats "
        "(strategies interleaved, order reversed on odd repeats).",
        "",
        "| router | hit rate (vLLM) | TTFT mean ms (range) | median | p90 (range) | p99 | busiest pod's share | "
        "server CPU (cores/pod) | API server CPU | /metrics req per pod per s | router CPU (cores) | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s, r in m.items():
        lo, hi = r["ttft_mean_ms_range"]
        p90_lo, p90_hi = r.get("ttft_p90_ms_range", [math.nan, math.nan])  # runs recorded before it was kept
        lines.append(
            f"| {s} | {r['hit_rate']:.2f} | {r['ttft_mean_ms']:.1f} ({lo:.0f}-{hi:.0f}) | {r['ttft_p50_ms']:.1f} | "
            f"{r['ttft_p90_ms']:.1f} ({p90_lo:.0f}-{p90_hi:.0f}) | {r['ttft_p99_ms']:.1f} | {r['max_share']:.2f} | {r['server_cpu_share']:.2f} | "
            f"{r['api_server_cpu_share']:.3f} | {r['metrics_requests_per_pod_per_s']:.2f} | "
            f"{'-' if math.isnan(r.get('router_cpu_share', math.nan)) else format(r['router_cpu_share'], '.3f')} | "
            f"{r['failed']:g} |")
    moves = [dict(r["pool_changes"]) for r in section["runs"] if r.get("pool_changes")]
    if moves:
        when = {what: statistics.median(mv[what] for mv in moves if what in mv)
                for what in ("left", "stopped", "joined") if any(what in mv for mv in moves)}
        lines += ["", "The pool changed at (median over the runs, seconds into the trace): "
                  + ", ".join(f"{what} {at:.0f} s" for what, at in when.items())
                  + " (left: out of the endpoints; stopped: drained and stopped; joined: the fresh server in)."]
    warm = [r["ttft_warm_p50_ms"] for r in m.values() if not math.isnan(r["ttft_warm_p50_ms"])]
    cold = [r["ttft_cold_p50_ms"] for r in m.values() if not math.isnan(r["ttft_cold_p50_ms"])]
    if warm and cold:
        first = spec["groups"] / spec["requests"]
        w, c = statistics.median(warm), statistics.median(cold)
        lines += ["", f"What a cache hit is worth on these servers: median TTFT {w:.1f} ms for a request served mostly "
                  f"from cache, {c:.1f} ms mostly cold. A router that is cold only on each group's first request "
                  f"({first:.1%} of them) and adds no delay would average about {first * c + (1 - first) * w:.1f} ms."]
    lines += where_ttft_goes(section["runs"], list(m))
    lines += first_placement_lines(section["runs"], list(m))
    lines += cross_pod_lines(section["runs"], list(m))
    lines += busier_pick_lines(section["runs"], list(m))
    lines += phase_lines(section["runs"], list(m))
    lines += paired_ratio_lines(section["runs"], list(m))
    lines += routing_cost_lines(section["runs"], m)
    lines += ["", "## Targets", "", "| target | met | measured |", "|---|---|---|"]
    for t in section["targets"]:
        lines.append(f"| {t['target']} | {'yes' if t['met'] else '**no**'} | {t['measured']} |")
    sim = section.get("sim") or {}
    if sim:
        slowdown = section.get("sim_slowdown", 1.0)
        also_model = ("" if model == RealSpec.model
                      else f"; with the {model} model it scales for the model as well as the machine")
        seeds = section.get("sim_seeds", 3)
        paths = section.get("sim_paths") or {}
        scrape_ms = RealSpec.recorded(section["spec"]).scrape_cost_s * 1000
        path_note = ("; each router's path as this run measured it (its requests reach the pod after Envoy's median "
                     "hold, its engines run slower by the CPU its processes took beyond the lightest of them: "
                     + ", ".join(f"{s} {p['delay_ms']:.2f} ms, x{p['engine_slowdown']:.3f}" for s, p in paths.items())
                     + ")") if paths else ""
        lines += ["", f"## The simulator on the same workload (fast mode, mean of {seeds} seeded traces)", "",
                  f"The small model's measured rates times {slowdown:.2f} (this run's cold requests took that many "
                  f"times the {SMALL_COLD_TTFT_MS:.0f} ms they took where the rates were measured"
                  f"{also_model}). "
                  f"Scrapes cost the pod's API server {scrape_ms:.2g} ms each{path_note}; the simulator's "
                  "tokenizer and prompts differ from the real ones (same token counts). Orderings count as the same when both "
                  "sides differ in the same direction or both are level (hit rates within 0.01, TTFT within 5 %).",
                  "",
                  "| router | hit rate | TTFT mean ms | median | p90 | busiest pod's share | /metrics per pod per s |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for s, r in sim.items():
            lines.append(f"| {s} | {r['hit_rate']:.2f} | {r['ttft_mean_ms']:.1f} | {r['ttft_p50_ms']:.1f} | "
                         f"{r['ttft_p90_ms']:.1f} | {r['max_share']:.2f} | {r['metrics_requests_per_pod_per_s']:.2f} |")
        rows = section.get("sim_direction") or []
        disagree = [r for r in rows if not r["agree"]]
        lines += ["", f"Pairwise orderings the simulator gets the same way as the real servers: "
                      f"**{len(rows) - len(disagree)}/{len(rows)}**."]
        lines += [f"- not: {r['figure']} {r['a']} - {r['b']}: real {r['real']:+.3g}, sim {r['sim']:+.3g}"
                  for r in disagree]
        overshot = mirror_overshoots(section["medians"], sim)
        if overshot:
            lines += ["", f"**The mirror is not meaningful here**: the simulated mean TTFT of {', '.join(overshot)} is "
                      f"over {MIRROR_OVERSHOOT:g}x the real one, so the simulated servers were saturated. The slowdown "
                      "is estimated from the cold requests' TTFT, which includes their queueing on a busy machine."]
    dropped = section.get("dropped") or {}
    if dropped.get("repeats"):
        lines += ["", "## Repeats left out", "", f"Repeat(s) {', '.join(map(str, dropped['repeats']))} of the "
                  f"combined runs, not in the figures above: {dropped.get('why') or 'no reason given'}.", "",
                  "| router | TTFT mean | p90 | hit rate |", "|---|---:|---:|---:|"]
        lines += [f"| {r['strategy']} | {r['ttft_mean_ms']:.1f} | {r['ttft_p90_ms']:.1f} | {r['hit_rate']:.3f} |"
                  for r in dropped["runs"] if "error" not in r]
    errors = [r for r in section["runs"] if "error" in r]
    if errors:
        lines += ["", "## Runs that failed", ""] + [f"- {r['strategy']} #{r['repeat']}: {r['error']}" for r in errors]
    lines += ["", "## Every run", "",
              "Cold requests (under half the prompt from cache) by cause: the group's first request (`first`), the "
              "group moved to a pod that did not hold it (`copy`), the pod had dropped it (`evicted`).", "",
              "| router | repeat | hit rate | TTFT mean | p90 | share | groups per pod | cold: first / copy / evicted | "
              "/metrics per pod per s |", "|---|---:|---:|---:|---:|---|---|---|---:|"]
    for r in section["runs"]:
        if "error" in r:
            continue
        causes = r.get("cold_causes") or {}
        lines.append(f"| {r['strategy']} | {r['repeat'] + 1} | {r['hit_rate']:.3f} | {r['ttft_mean_ms']:.1f} | "
                     f"{r['ttft_p90_ms']:.1f} | {'/'.join(f'{x:.2f}' for x in r['share'])} | "
                     f"{'/'.join(str(g) for g in r.get('groups_per_pod') or [])} | "
                     f"{' / '.join(str(causes.get(k, '-')) for k in ('first', 'copy', 'evicted'))} | "
                     f"{max(r['metrics_requests_per_pod_per_s'] or [0.0]):.2f} |")
    lines.append("")
    return "\n".join(lines)


def workload_text(spec: dict[str, Any]) -> str:
    """The workload in a report's words, from a run's recorded spec."""
    if spec.get("turns"):
        return (f"{spec['groups']} conversations x {spec['turns']} turns, a {spec['system_tokens']}-token first "
                f"message then {spec['question_tokens']}-token questions, {spec['output_tokens']}-token answers "
                f"appended to the context, think time {spec['think_s']:g} s, starts at {spec['rate']:g} / turns per s")
    weights = spec.get("group_weights")
    popularity = f" dealt out by popularity {'/'.join(f'{w:g}' for w in weights)}" if weights else ""
    leave = (f"; the last server leaves (out of the endpoints, drained, stopped) at {spec['leave_at']:.0%} of the "
             f"trace and a fresh one joins at {spec['rejoin_at']:.0%}" if spec.get("leave_at") else "")
    return (f"{spec['groups']} groups x {spec['prompts_per_group']} prompts{popularity}, {spec['system_tokens']}-token "
            f"shared system prompts, {spec['question_tokens']}-token questions, {spec['output_tokens']} output "
            f"tokens, Poisson {spec['rate']:g} req/s{leave}")


def plot(section: dict[str, Any], path: Path) -> None:
    """TTFT CDF per router (every repeat pooled); skipped without matplotlib (the bench extra)."""
    try:
        from picker_lab.bench.plots import pyplot
    except ImportError:
        print(f"picker bench: matplotlib missing ({lab_install_hint('bench')}): no plot", file=sys.stderr)
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for s in section["medians"]:
        values = np.sort([row[TTFT_COLUMN] for r in section["runs"] if r["strategy"] == s and "error" not in r
                          for row in r.get("requests_detail", ())])
        if values.size:
            ax.plot(values, np.arange(1, values.size + 1) / values.size, label=s)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT on real vLLM servers, every repeat")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
