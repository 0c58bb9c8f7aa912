"""Fleet scenarios: routers as production runs them, N replicas behind one load balancer, through what production
goes through. Live mode (`picker sim` pods, real processes), every router on the same pods and the same trace,
repeated with the routers' order reversed on every other repeat (interleaved), medians and ranges reported.

- `replicas`: steady traffic, nothing disrupted (the live mode's figures, repeated).
- `router-restart`: the router's replicas restarted one at a time mid-run, as a Deployment rolls (SIGTERM, the
  same command started again); each restart is measured over the window from its stop to the next restart (gap_s),
  and over the minute after its stop (minute_s, later restarts included: the issue's measure), against the same
  router's undisturbed run of the same trace over the same windows: TTFT p90 and cold prefills (requests served
  from cache for under half of what the infinite-cache oracle could).
- `pod-restart`: one model-server pod (the last, in a process of its own) restarted mid-run, its cache empty when
  it returns: requests the router sends it afterwards for a prefix only its old cache held ("misled": the prefix,
  its shared-prefix group or its conversation, was served there before the restart and not since) are counted.
- `valkey-outage`: the Valkey the picker's replicas share killed mid-run and started again (empty) `--outage`
  later: failed requests, and how long after its return every replica has applied every other replica's picks
  (each replica's backlog published, `picker_prefix_index_sync_*`), and TTFT p90 and cold prefills from the outage
  to `after_s` past its end against the same run left alone. Only routers with a Valkey take part.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import math
import statistics
import time
import urllib.request
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from picker_lab.bench import peers
from picker_lab.bench.capacity import cost_per_request, rate_for_load
from picker_lab.bench.live import (
    LiveSpec,
    Router,
    _measure,
    _wait_pods_ready,
    pod_healthy,
    router_cpu,
    start_router,
)
from picker_lab.bench.progress import ProgressBar
from picker_lab.bench.results import FAILED, OK, RunResult
from picker_lab.bench.summary import percentile, summarize
from picker_lab.bench.trace import Trace
from picker_lab.bench.workloads import FleetSpec, generate
from picker_lab.supervisor import Backends, Managed, free_port_range, port_open, process_scope, start_sim


@dataclass(frozen=True)
class ScenarioSpec:
    live: LiveSpec
    scenario: str = "replicas"
    repeats: int = 3
    settle_s: float = 8.0  # wall seconds of traffic before the first disruption
    gap_s: float = 10.0  # router-restart: wall seconds between two restarts (each one's window)
    minute_s: float = 60.0  # router-restart: wall seconds after each restart's stop measured as its minute
    outage_s: float = 30.0  # valkey-outage: wall seconds Valkey stays away
    after_s: float = 20.0  # pod-restart, valkey-outage: wall seconds of traffic measured after the return

    def wall_seconds(self, replicas: int) -> float:
        """How long a run must last for the scenario to play out."""
        if self.scenario == "router-restart":
            return self.settle_s + self.gap_s * (replicas - 1) + max(self.gap_s * 1.5, self.minute_s)
        if self.scenario == "valkey-outage":
            return self.settle_s + self.outage_s + self.after_s
        if self.scenario == "pod-restart":
            return self.settle_s + self.after_s
        return 0.0


@dataclass
class Disruption:
    """One thing done to the fleet during a run; times in model seconds from the run's start."""

    what: str
    down: float
    back: float
    window_end: float = math.inf  # the end of the window measured after it (router-restart)
    minute_end: float = math.inf  # router-restart: the end of the minute after its stop
    agreed_after_s: float | None = None  # valkey-outage: wall seconds from Valkey's return to the replicas agreeing
    # valkey-outage: each replica's _sync_counts when last asked
    sync_counts: list[Any] = field(default_factory=list)


async def _at(start: float, wall_s: float) -> None:
    await asyncio.sleep(max(0.0, start + wall_s - time.monotonic()))


async def _restart(proc: Managed, ready: Callable[[], bool], within_s: float = 60.0) -> None:
    """Restart `proc` in place (blocking steps in a thread: the replay shares this loop) and wait until it serves."""
    await asyncio.to_thread(proc.restart)
    deadline = time.monotonic() + within_s
    while not await asyncio.to_thread(ready):
        if time.monotonic() > deadline or not proc.alive():
            raise RuntimeError(f"{proc.name} did not serve again after its restart: {proc.log_tail(4)}")
        await asyncio.sleep(0.05)


def _sync_counts(address: str) -> tuple[float, float, float, float, float]:
    """A picker replica's shared-index counters: (sent, received or refused as stale, pending, connected, stale)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=2) as resp:
        text = resp.read().decode()
    values = {"sent": 0.0, "received": 0.0, "pending": 0.0, "connected": 0.0, "stale": 0.0}
    for line in text.splitlines():
        if line.startswith('picker_prefix_index_sync_entries_total{direction="sent"}'):
            values["sent"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(('picker_prefix_index_sync_entries_total{direction="received"}',
                              'picker_prefix_index_sync_entries_total{direction="stale"}')):
            values["received"] += float(line.rsplit(" ", 1)[1])  # a stale pick refused was read all the same
            if "stale" in line:
                values["stale"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("picker_prefix_index_sync_pending "):
            values["pending"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("picker_prefix_index_sync_connected "):
            values["connected"] = float(line.rsplit(" ", 1)[1])
    return values["sent"], values["received"], values["pending"], values["connected"], values["stale"]


def replicas_agree(addresses: list[str], seen: list[Any]) -> bool:
    """Every replica connected with nothing left to publish, and each has applied every pick the others had
    published when it was asked (the published counts read first, the applied ones after). What was read goes
    to `seen` (the last reading says why they did not agree)."""
    before = [_sync_counts(a) for a in addresses]
    seen[:] = [before]
    if any(pending or not connected for _, _, pending, connected, _ in before):
        return False
    time.sleep(0.05)  # a pick published just before must have had time to be read (normally milliseconds)
    after = [_sync_counts(a) for a in addresses]
    seen.append(after)
    sent = [s for s, *_ in before]
    return all(after[i][1] >= sum(sent) - sent[i] for i in range(len(addresses)))


def disruptions(spec: ScenarioSpec, router: Router, pod: Managed | None, pod_ready: Callable[[], bool],
                log: list[Disruption]) -> Callable[[float], Coroutine[Any, Any, None]] | None:
    """The coroutine a run of `spec.scenario` plays alongside its replay (None for steady traffic); what it did
    goes to `log`."""
    scale = spec.live.time_scale

    def model(start: float, t: float) -> float:
        return (t - start) * scale

    async def rolling(start: float) -> None:
        for i, (proc, ready) in enumerate(router.replicas):
            await _at(start, spec.settle_s + i * spec.gap_s)
            down = time.monotonic()
            await _restart(proc, ready)
            log.append(Disruption(f"replica {i} restarted", model(start, down), model(start, time.monotonic()),
                                  model(start, start + spec.settle_s + (i + 1) * spec.gap_s),
                                  minute_end=model(start, down + spec.minute_s)))

    async def pod_restart(start: float) -> None:
        assert pod is not None
        await _at(start, spec.settle_s)
        down = time.monotonic()
        await _restart(pod, pod_ready)
        log.append(Disruption(f"{pod.name} restarted", model(start, down), model(start, time.monotonic())))

    async def outage(start: float) -> None:
        assert router.valkey is not None
        addresses = [f"{p.host}:{p.metrics_port}" for p in router.pickers]
        await _at(start, spec.settle_s)
        down = time.monotonic()
        await asyncio.to_thread(router.valkey.process.kill)
        await _at(start, spec.settle_s + spec.outage_s)
        valkey = router.valkey
        await _restart(valkey.process, lambda: port_open(valkey.port))
        back = time.monotonic()
        agreed = None
        seen: list[Any] = []
        while time.monotonic() - back < 30:
            if await asyncio.to_thread(replicas_agree, addresses, seen):
                agreed = time.monotonic() - back
                break
            await asyncio.sleep(0.1)
        log.append(Disruption("valkey killed and restarted", model(start, down), model(start, back),
                              model(start, back + spec.after_s), agreed_after_s=agreed, sync_counts=seen))

    return {"router-restart": rolling, "pod-restart": pod_restart, "valkey-outage": outage}.get(spec.scenario)


# --- what a run says -----------------------------------------------------------------------------------------------
def cold(res: RunResult, i: int) -> bool:
    """Served from cache for under half of what the infinite-cache oracle held for it (at least a block's worth)."""
    return res.status[i] == OK and res.oracle_cached[i] > 0 and res.cached_tokens[i] < res.oracle_cached[i] / 2


def window(res: RunResult, begin: float, end: float) -> dict[str, float]:
    """TTFT p90 and cold prefills of the requests sent in [begin, end) (model seconds)."""
    chosen = [i for i, t in enumerate(res.sent) if begin <= t < end]
    ttft = [res.ttft[i] for i in chosen if res.status[i] == OK and not math.isnan(res.ttft[i])]
    return {"requests": len(chosen), "ttft_p90": percentile(ttft, 90), "cold": sum(cold(res, i) for i in chosen)}


def prefix_of(trace: Trace, i: int) -> int:
    """What a request's cached prefix belongs to: its shared-prefix group, else its conversation's first turn."""
    request = trace.requests[i]
    if request.group >= 0:
        return request.group
    while request.parent >= 0:
        request = trace.requests[request.parent]
    return -1 - request.index


def misled(trace: Trace, res: RunResult, pod: int, down: float) -> dict[str, int]:
    """Requests sent to `pod` after it restarted (at `down`) for a prefix only its lost cache held: served there
    before the restart and not since."""
    order = sorted(range(res.n), key=lambda i: res.sent[i])
    before = {prefix_of(trace, i) for i in order if res.sent[i] < down and res.pod[i] == pod}
    since: set[int] = set()
    count = sent_there = 0
    for i in order:
        if res.sent[i] < down or res.pod[i] != pod:
            continue
        sent_there += 1
        key = prefix_of(trace, i)
        count += key in before and key not in since
        since.add(key)
    return {"misled": count, "sent_to_restarted_pod": sent_there}


def recovery(res: RunResult, pod: int, back: float, first: int = 30) -> dict[str, float]:
    """How fast the restarted pod's cache fills again: the share of prompt tokens served from cache over its first
    `first` requests after it came back, against the same over every pod's first `first` requests of the run
    (pods that start empty too, with nothing known of them)."""
    def share(chosen: list[int]) -> float:
        prompt = sum(res.prompt_tokens[i] for i in chosen)
        return sum(res.cached_tokens[i] for i in chosen) / prompt if prompt else math.nan

    order = sorted((i for i in range(res.n) if res.status[i] == OK), key=lambda i: res.sent[i])
    after = [i for i in order if res.pod[i] == pod and res.sent[i] >= back][:first]
    fresh = [share([i for i in order if res.pod[i] == k][:first]) for k in range(res.pods)]
    fresh = [v for v in fresh if not math.isnan(v)]
    return {"hit_after_restart": share(after), "hit_fresh_pods": statistics.mean(fresh) if fresh else math.nan}


def figures(res: RunResult) -> dict[str, float]:
    """The run's own figures; the hit rate from the requests' usage (a restarted pod's counters start over)."""
    summary = summarize(res)
    ok = [i for i in range(res.n) if res.status[i] == OK]
    prompt = sum(res.prompt_tokens[i] for i in ok)
    return {"hit_rate": sum(res.cached_tokens[i] for i in ok) / prompt if prompt else math.nan,
            "ttft_mean": summary["ttft_mean"], "ttft_p90": summary["ttft_p90"], "ttft_p99": summary["ttft_p99"],
            "failed": sum(s == FAILED for s in res.status), "cold": sum(cold(res, i) for i in range(res.n))}


def takes_part(scenario: str, router: str) -> bool:
    name, replicas, _ = peers.replicated(router)
    if scenario == "router-restart":
        return name != "round-robin"
    if scenario == "valkey-outage":
        return replicas > 1 and name in ("picker", "prefix-only")
    return True


# --- the runs ----------------------------------------------------------------------------------------------------
def _start_pods(spec: ScenarioSpec, logdir: Path, extra: list[str]) -> tuple[list[str], Managed, Managed | None]:
    """The sim pods' addresses, the fleet's process and, for pod-restart, the last pod in a process of its own."""
    live = spec.live
    if spec.scenario != "pod-restart":
        sim = start_sim(live.pods, logdir, time_scale=live.time_scale, extra=extra)
        return sim.addresses, sim.process, None
    if live.pods < 2:
        raise ValueError("pod-restart needs at least 2 pods")
    base = free_port_range(live.pods)
    rest: Backends = start_sim(live.pods - 1, logdir, time_scale=live.time_scale, extra=extra, base_port=base)
    alone = start_sim(1, logdir, time_scale=live.time_scale, extra=extra, base_port=base + live.pods - 1,
                      first_pod=live.pods - 1, name="sim-restarting")
    return rest.addresses + alone.addresses, rest.process, alone.process


def run_scenario(spec: ScenarioSpec, out: Path) -> dict[str, Any]:
    """Every router of `spec.live.order` that takes part, `spec.repeats` times interleaved; writes fleet.json and
    fleet.md to `out` and returns the report."""
    live = spec.live
    profile = live.get_profile()
    routers = [r for r in live.order if takes_part(spec.scenario, r)]
    if not routers:
        raise ValueError(f"no router of {', '.join(live.order)} takes part in {spec.scenario}")
    rate = rate_for_load(live.load, live.pods, cost_per_request(live.workload, FleetSpec(profile, live.pods),
                                                                 live.seed, live.params))
    longest = max(peers.replicated(r)[1] for r in routers)
    requests = max(live.requests, math.ceil(spec.wall_seconds(longest) * rate * live.time_scale))
    trace = generate(live.workload, requests, rate, live.seed, FleetSpec(profile, live.pods), **live.params)
    # their windows are compared with the same router's run of the same trace left alone
    undisturbed = spec.scenario in ("router-restart", "valkey-outage")
    runs: dict[str, list[dict[str, Any]]] = {r: [] for r in routers}
    skipped: dict[str, str] = {}
    bar = ProgressBar(len(trace) * len(routers) * spec.repeats * (2 if undisturbed else 1), spec.scenario)
    extra = ["--profile", profile.name, "--seed", str(live.seed), "--num-gpu-blocks", str(live.num_gpu_blocks)]
    try:
        with process_scope(f"bench-{spec.scenario}") as (logdir, started):
            addresses, sim, alone = _start_pods(spec, logdir, extra)
            started += [p for p in (sim, alone) if p is not None]
            urls = [f"http://{a}" for a in addresses]
            _wait_pods_ready(urls)
            pod_ready = functools.partial(pod_healthy, urls[-1])
            for repeat in range(spec.repeats):
                for name in routers if repeat % 2 == 0 else routers[::-1]:
                    if name in skipped:
                        continue
                    bar.set_label(f"{spec.scenario}: {name} ({repeat + 1}/{spec.repeats})")
                    try:
                        row = _one_router(spec, name, trace, addresses, urls, logdir, alone, pod_ready, bar,
                                          undisturbed, started)
                    except (RuntimeError, TimeoutError, OSError) as exc:
                        skipped[name] = str(exc)[:400]
                        continue
                    runs[name].append(row)
    finally:
        bar.close()
    report = {"scenario": spec.scenario, "spec": {**asdict(spec), "live": asdict(live)}, "requests": requests,
              "rate_rps": rate, "wall_rate_rps": rate * live.time_scale, "runs": runs, "skipped": skipped,
              "medians": {r: medians(rows) for r, rows in runs.items() if rows},
              "noise": {r: noise(rows) for r, rows in runs.items() if undisturbed and len(rows) > 1}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "fleet.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "fleet.md").write_text("\n".join(markdown(report)) + "\n")
    return report


def _one_router(spec: ScenarioSpec, name: str, trace: Trace, addresses: list[str], urls: list[str], logdir: Path,
                alone: Managed | None, pod_ready: Callable[[], bool], bar: ProgressBar, undisturbed: bool,
                started: list[Managed]) -> dict[str, Any]:
    """One repeat of one router: its undisturbed run when the scenario compares with one, then the scenario's."""
    live = spec.live
    model = live.get_profile().model
    row: dict[str, Any] = {}
    for disturbed in ((False, True) if undisturbed else (True,)):
        router = start_router(name, live, addresses, urls, logdir)
        started.extend(router.processes)
        log: list[Disruption] = []
        try:
            during = disruptions(spec, router, alone, pod_ready, log) if disturbed else None
            cpu = router_cpu(router.processes)
            res = asyncio.run(_measure(name, router.url, live, trace, urls, model, bar, during))
            cpu = router_cpu(router.processes) - cpu
        finally:
            router.stop()
            for proc in router.processes:
                started.remove(proc)
        key = "disturbed" if disturbed else "undisturbed"
        row[key] = {**figures(res), "router_cpu_s": cpu, "disruptions": [asdict(d) for d in log]}
        row[f"_{key}"] = res
    return _compare(spec, trace, row)


def _compare(spec: ScenarioSpec, trace: Trace, row: dict[str, Any]) -> dict[str, Any]:
    """The scenario's own figures, from the run(s) of one repeat."""
    res: RunResult = row.pop("_disturbed")
    calm: RunResult | None = row.pop("_undisturbed", None)
    log = row["disturbed"]["disruptions"]
    if calm is not None:
        def both(begin: float, end: float) -> dict[str, dict[str, float]]:
            return {"after": window(res, begin, end), "undisturbed": window(calm, begin, end)}

        row["windows"] = [both(d["down"], d["window_end"]) for d in log]
        row.update(_ratios(row["windows"], "after", "undisturbed", "window"))
        row["extra_cold"] = sum(w["after"]["cold"] - w["undisturbed"]["cold"] for w in row["windows"])
        minutes = [d for d in log if math.isfinite(d["minute_end"])]
        if minutes:
            row["minutes"] = [both(d["down"], d["minute_end"]) for d in minutes]
            row.update(_ratios(row["minutes"], "after", "undisturbed", "minute"))
            # the minutes overlap: cold prefills once over their span, from the first stop to the last minute's end
            row["span"] = both(minutes[0]["down"], max(d["minute_end"] for d in minutes))
            row["extra_cold_span"] = row["span"]["after"]["cold"] - row["span"]["undisturbed"]["cold"]
    if spec.scenario == "pod-restart" and log:
        row.update(misled(trace, res, spec.live.pods - 1, log[0]["down"]))
        row.update(recovery(res, spec.live.pods - 1, log[0]["back"]))
    if spec.scenario == "valkey-outage" and log:
        row["agreed_after_s"] = log[0]["agreed_after_s"]
    return row


# --- the report --------------------------------------------------------------------------------------------------
SCENARIO_FIGURES = ("window_p90_ratio", "worst_window_p90_ratio", "extra_cold", "minute_p90_ratio",
                    "worst_minute_p90_ratio", "extra_cold_span", "misled", "sent_to_restarted_pod",
                    "hit_after_restart", "hit_fresh_pods", "agreed_after_s")


# the router-restart columns, in the report's order
RESTART_FIGURES = ("window_p90_ratio", "worst_window_p90_ratio", "extra_cold", "minute_p90_ratio",
                   "worst_minute_p90_ratio", "extra_cold_span")


def _ratios(windows: list[dict[str, Any]], key: str, base: str, name: str) -> dict[str, float]:
    """TTFT p90 of each window's `key` run over its `base` run: the median window and the worst, as
    `{name}_p90_ratio` and `worst_{name}_p90_ratio` (nothing where no window has a base p90)."""
    ratios = [w[key]["ttft_p90"] / w[base]["ttft_p90"] for w in windows if w[base]["ttft_p90"] > 0]
    if not ratios:
        return {}
    return {f"{name}_p90_ratio": statistics.median(ratios), f"worst_{name}_p90_ratio": max(ratios)}


def medians(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """figure -> [median, min, max] over the repeats."""
    table: dict[str, list[float]] = {}
    values: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row["disturbed"].items():
            if isinstance(value, int | float):
                values.setdefault(key, []).append(float(value))
        for key in SCENARIO_FIGURES:
            if isinstance(row.get(key), int | float):
                values.setdefault(key, []).append(float(row[key]))
    for key, got in values.items():
        clean = [v for v in got if not math.isnan(v)]
        table[key] = _spread(clean) if clean else [math.nan] * 3
    return table


def _spread(values: list[float]) -> list[float]:
    """[median, min, max] of `values` (not empty)."""
    return [float(np.median(values)), min(values), max(values)]


def noise(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """What the scenario's window figures read with nothing done: the same windows of two undisturbed runs of one
    router (every ordered pair of repeats), as [median, min, max] over the pairs. A restart or an outage costs
    something only where its figures lie beyond these."""
    values: dict[str, list[float]] = {}
    for a, b in itertools.permutations(rows, 2):
        for name in ("window", "minute"):
            listed = f"{name}s"
            if listed not in a or listed not in b or len(a[listed]) != len(b[listed]):
                continue
            pairs = [{"a": x["undisturbed"], "b": y["undisturbed"]} for x, y in zip(a[listed], b[listed], strict=True)]
            for figure, value in _ratios(pairs, "a", "b", name).items():
                values.setdefault(figure, []).append(value)
            if name == "window":
                values.setdefault("extra_cold", []).append(float(sum(p["a"]["cold"] - p["b"]["cold"] for p in pairs)))
        if "span" in a and "span" in b:
            values.setdefault("extra_cold_span", []).append(
                float(a["span"]["undisturbed"]["cold"] - b["span"]["undisturbed"]["cold"]))
    return {k: _spread(v) for k, v in values.items() if v}


def _cell(figure: list[float] | None, fmt: str, scale: float = 1.0) -> str:
    if not figure or math.isnan(figure[0]):
        return "-"
    med, lo, hi = (v * scale for v in figure)
    return f"{med:{fmt}} [{lo:{fmt}}-{hi:{fmt}}]" if hi > lo else f"{med:{fmt}}"


def markdown(report: dict[str, Any]) -> list[str]:
    live = report["spec"]["live"]
    spec = report["spec"]
    lines = [f"# Fleet scenario `{report['scenario']}`", "",
             f"Live mode: {live['workload']}, {live['pods']} simulated pods (`{live['profile']}`, time scale "
             f"{live['time_scale']}), {report['requests']} requests at {report['wall_rate_rps']:.1f} req/s wall "
             f"per run, {spec['repeats']} repeats interleaved (order reversed every other repeat); medians, the "
             "repeats' range in brackets; TTFT in model ms.", ""]
    scenario = report["scenario"]
    extra_head = {"router-restart": ["p90 after a restart / undisturbed (median window)", "worst window",
                                     "extra cold prefills (all windows)",
                                     "p90 in the minute after each restart / undisturbed (median)", "worst minute",
                                     "extra cold prefills (first restart to last minute's end)"],
                  "pod-restart": ["sent to the restarted pod", "misled (for a prefix only its lost cache held)",
                                  "its hit rate, first 30 after / fresh pods' first 30"],
                  "valkey-outage": ["p90 from the outage to 20 s after / undisturbed", "extra cold prefills",
                                    "replicas agree after Valkey returns (s)"]}.get(scenario, [])
    head = ["router", "hit rate", "TTFT mean", "TTFT p90", "TTFT p99", "failed", "router CPU s", *extra_head]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for router, m in report["medians"].items():
        cells = [router, _cell(m.get("hit_rate"), ".3f"), _cell(m.get("ttft_mean"), ".0f", 1e3),
                 _cell(m.get("ttft_p90"), ".0f", 1e3), _cell(m.get("ttft_p99"), ".0f", 1e3),
                 _cell(m.get("failed"), ".0f"), _cell(m.get("router_cpu_s"), ".1f")]
        if scenario == "router-restart":
            cells += [_cell(m.get(figure), ".0f" if "cold" in figure else ".2f") for figure in RESTART_FIGURES]
        elif scenario == "pod-restart":
            cells += [_cell(m.get("sent_to_restarted_pod"), ".0f"), _cell(m.get("misled"), ".0f"),
                      f"{_cell(m.get('hit_after_restart'), '.2f')} / {_cell(m.get('hit_fresh_pods'), '.2f')}"]
        elif scenario == "valkey-outage":
            cells += [_cell(m.get("window_p90_ratio"), ".2f"), _cell(m.get("extra_cold"), ".0f"),
                      _cell(m.get("agreed_after_s"), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    floor = report.get("noise", {})
    if floor and scenario in ("router-restart", "valkey-outage"):
        lines += ["", "Nothing done (noise): the same windows of two undisturbed runs of each router, every ordered "
                  "pair of repeats, medians [range].", "",
                  "| router | p90 / undisturbed (median window) | worst window | extra cold prefills | minute after "
                  "(median) | worst minute | extra cold prefills (span) |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {router} | " + " | ".join(_cell(n.get(figure), ".0f" if "cold" in figure else ".2f")
                                                for figure in RESTART_FIGURES) + " |" for router, n in floor.items()]
    for router, why in report["skipped"].items():
        lines.append(f"\n- skipped **{router}**: {why}")
    return lines
