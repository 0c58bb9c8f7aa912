"""What a real-engine run's per-request rows say: which requests were cold and why, where their time to first token
went, how the routers placed each prefix first and whether a pick went to the busier pod; the report's lines on
them. Pure functions of the rows `picker_lab.bench.real` records (pod, cached tokens, times)."""

from __future__ import annotations

import math
import statistics
from typing import Any, NamedTuple

import numpy as np

from picker_lab.bench.peers import is_peer
from picker_lab.bench.summary import percentile

# The hash baselines: `picker serve --strategy NAME`, reading no metrics.
HASH_BASELINES = ("hash-ring", "bounded-load", "prefix-hash")
# A request with less than this share of its prompt from the cache counts as served cold.
COLD_SHARE = 0.5


def request_rows(records: list[dict[str, Any]], pods: list[str]) -> list[list[float]]:
    """Answered requests as DETAIL_COLUMNS rows in send order (sent_s from the first send; pod: index into
    `pods`, -1 when unknown)."""
    if not records:
        return []
    ordered = sorted(records, key=lambda r: r["sent"])
    start = ordered[0]["sent"]
    index = {address: i for i, address in enumerate(pods)}
    rows = []
    for r in ordered:
        usage = r.get("usage") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        rows.append([round(r["sent"] - start, 4), r["group"], index.get(r.get("pod", ""), -1),
                     int(usage.get("prompt_tokens") or 0), cached, round((r["first_chunk"] - r["sent"]) * 1000, 2)])
    return rows


def is_cold(prompt_tokens: float, cached_tokens: float) -> bool:
    """Served mostly cold: less than COLD_SHARE of the prompt came from the cache (or no usage was reported)."""
    return prompt_tokens <= 0 or cached_tokens < COLD_SHARE * prompt_tokens


def cold_kinds(rows: list[list[float]]) -> list[str]:
    """For each DETAIL_COLUMNS row (send order): `warm`, or why it was cold: the first of its group anywhere
    (`first`: no router avoids it), the first of its group on this pod while another pod held it (`copy`: the
    router moved the group), or its group had been served by this pod before (`evicted`: the pod's cache dropped
    the prefix)."""
    seen: set[float] = set()
    seen_on: set[tuple[float, float]] = set()
    kinds = []
    for _sent, group, pod, prompt, cached, _ttft in rows:
        if not is_cold(prompt, cached):
            kinds.append("warm")
        else:
            kinds.append("first" if group not in seen else ("copy" if (group, pod) not in seen_on else "evicted"))
        seen.add(group)
        seen_on.add((group, pod))
    return kinds


def cold_causes(rows: list[list[float]]) -> dict[str, int]:
    """How many of a run's cold requests were cold for each reason (`cold_kinds`)."""
    kinds = cold_kinds(rows)
    return {cause: kinds.count(cause) for cause in ("first", "copy", "evicted")}


def cold_spans(rows: list[list[float]]) -> list[tuple[float, float, float]]:
    """(sent, first token, pod) of each cold request in DETAIL_COLUMNS rows: while it prefills its pod is busy."""
    return [(sent, sent + ttft / 1000, pod) for sent, _g, pod, prompt, cached, ttft in rows if is_cold(prompt, cached)]


def behind_cold(sent: float, pod: float, colds: list[tuple[float, float, float]]) -> bool:
    """Whether a request sent at `sent` to `pod` found a cold request still prefilling there (`cold_spans`)."""
    return any(start <= sent < end and cold_pod == pod for start, end, cold_pod in colds)


def ttft_breakdown(rows: list[list[float]]) -> dict[str, dict[str, float]]:
    """Where a run's TTFT went, from its DETAIL_COLUMNS rows: cold requests (under half the prompt cached), warm
    ones sent while a cold request on the same pod still awaited its first token (they queue behind a long
    prefill step), and the other warm ones. Per class: how many, their mean TTFT, their share of all TTFT."""
    colds = cold_spans(rows)
    classes: dict[str, list[float]] = {"cold": [], "warm_behind_cold": [], "warm_clear": []}
    for sent, _g, pod, prompt, cached, ttft in rows:
        if is_cold(prompt, cached):
            classes["cold"].append(ttft)
        elif behind_cold(sent, pod, colds):
            classes["warm_behind_cold"].append(ttft)
        else:
            classes["warm_clear"].append(ttft)
    total = sum(sum(v) for v in classes.values()) or 1.0
    return {name: {"n": len(v), "mean_ms": statistics.fmean(v) if v else math.nan, "share": sum(v) / total}
            for name, v in classes.items()}


def first_placements(rows: list[list[float]], pods: int) -> list[tuple[float, float, float, float]]:
    """For each group's first request (cold under any router: `cold_kinds`' "first"), from the DETAIL_COLUMNS rows of a run on `pods`
    servers: the uncached prompt tokens still prefilling (sent before it, first token after its send) on the pod it
    went to and on the lightest other pod, the requests that reached its pod while it prefilled, and its TTFT. Did
    the router send the one request no router can serve warm where the least work stood ahead of it?"""
    spans = [(sent, sent + ttft / 1000, pod, prompt - cached) for sent, _g, pod, prompt, cached, ttft in rows]
    out = []
    for (sent, _group, pod, _prompt, _cached, ttft), kind in zip(rows, cold_kinds(rows), strict=True):
        if kind != "first" or pod < 0:  # not its group's first, or the answering pod is unknown
            continue
        ahead = [0.0] * pods
        for start, end, other, uncached in spans:
            if start < sent < end and other >= 0:
                ahead[int(other)] += uncached
        others = [work for p, work in enumerate(ahead) if p != pod]
        joined = sum(1 for start, _end, other, _u in spans if other == pod and sent < start < sent + ttft / 1000)
        out.append((ahead[int(pod)], min(others) if others else math.nan, float(joined), ttft))
    return out


def cross_pod_warm(rows: list[list[float]]) -> dict[str, list[float]]:
    """The TTFTs of a run's warm requests that no cold prefill on their own pod delayed, split by whether another
    pod was prefilling a cold request meanwhile (`other_cold`) or not (`clear`). On a machine whose servers share
    cores and memory bandwidth a cold prefill on one slows the other's requests; on a fleet with an accelerator per
    pod it cannot, so this says how much of a comparison here is the machine's."""
    colds = cold_spans(rows)
    out: dict[str, list[float]] = {"clear": [], "other_cold": []}
    for sent, _g, pod, prompt, cached, ttft in rows:
        if is_cold(prompt, cached) or behind_cold(sent, pod, colds):
            continue
        done = sent + ttft / 1000
        other = any(p != pod and start < done and sent < end for start, end, p in colds)
        out["other_cold" if other else "clear"].append(ttft)
    return out


def busier_picks(rows: list[list[float]]) -> tuple[int, int]:
    """(picks, picks onto a pod with more requests awaiting their first token than some other pod had when it was
    sent) over a run's DETAIL_COLUMNS rows on known pods: how well a router spreads arrivals over the prefills in
    progress, which is what delays a warm request's first token."""
    spans = [(sent, sent + ttft / 1000, int(pod)) for sent, _g, pod, _p, _c, ttft in rows if pod >= 0]
    pods = 1 + max((pod for _s, _e, pod in spans), default=0)
    busier = 0
    for sent, _end, pod in spans:
        waiting = [0] * pods
        for start, end, other in spans:
            if start < sent < end:
                waiting[other] += 1
        busier += waiting[pod] > min(waiting)
    return len(spans), busier


def routing_cost_lines(runs: list[dict[str, Any]], m: dict[str, dict[str, Any]]) -> list[str]:
    """The report's section on what each router cost on the way (Envoy's timing log, `routing_delays`; medians
    over `runs`, so a report re-rendered from an older real.json has it too) and in CPU taken from the cores the
    engines run on (`m`, the `medians`); empty for runs recorded without the log."""
    rows = []
    for name, r in m.items():
        held = held_medians([run for run in runs if run["strategy"] == name and "error" not in run])
        if held:
            (req50, req90), (resp50, resp90) = held["request_held_ms"], held["response_held_ms"]
            rows.append(f"| {name} | {req50:.2f} / {req90:.2f} | {resp50:.2f} / {resp90:.2f} | "
                        f"{r['router_cpu_share']:.3f} | {r['server_cpu_share']:.3f} |")
        elif is_peer(name) and not math.isnan(r["router_cpu_share"]):  # no Envoy to time it: its CPU all the same
            rows.append(f"| {name} | (no Envoy) | (no Envoy) | {r['router_cpu_share']:.3f} | "
                        f"{r['server_cpu_share']:.3f} |")
    return _table_section(
        "What routing costs each request",
        "Envoy's own timing of each request, medians over the repeats: from its first byte reaching Envoy to its "
        "first byte sent to the pod (with the picker: its answers to the request's headers and body), and from the "
        "pod's first response byte to the client's (the picker's answer to the response headers); with the CPU the "
        "router's processes took and the engines got, in cores (they share the machine's cores).",
        ["| router | request held p50 / p90 ms | response held p50 / p90 ms | router CPU | engine CPU per pod |",
         "|---|---:|---:|---:|---:|"], rows)


def _paired_cells(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[str]:
    """Median (range) of mine / theirs over paired repeats, for the TTFT mean and p90."""
    cells = []
    for figure in ("ttft_mean_ms", "ttft_p90_ms"):
        ratios = [mine[figure] / theirs[figure] for mine, theirs in pairs]
        cells.append(f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    return cells


def _pairs(runs: list[dict[str, Any]], mine: str, theirs: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(mine's run, theirs') for every repeat both completed."""
    other = {r["repeat"]: r for r in runs if r["strategy"] == theirs and "error" not in r}
    return [(r, other[r["repeat"]]) for r in runs
            if r["strategy"] == mine and "error" not in r and r["repeat"] in other]


def paired_ratio_lines(runs: list[dict[str, Any]], strategies: list[str]) -> list[str]:
    """The report's sections comparing routers repeat by repeat (the same trace, minutes apart): a machine whose
    speed moves between repeats moves both alike, so these ratios are steadier than the ratio of medians. First each
    router against a baseline (round-robin, else the hash ring, else bounded-load: the first the run has), then the
    picker against every other router (how many repeats it was the faster in)."""
    ran = {r["strategy"] for r in runs if "error" not in r}
    lines: list[str] = []
    baseline = next((b for b in ("round-robin", *HASH_BASELINES) if b in ran), None)
    if baseline is not None:
        rows = []
        for name in strategies:
            pairs = _pairs(runs, name, baseline) if name != baseline else []
            if pairs:
                cells = _paired_cells(pairs)
                rows.append(f"| {name} | {len(pairs)} | {cells[0]} | {cells[1]} |")
        lines += _table_section(
            f"Against {baseline}, repeat by repeat",
            f"Each repeat's figure over {baseline}'s in the same repeat: median (range) over the repeats.",
            [f"| router | repeats | TTFT mean / {baseline}'s | p90 / {baseline}'s |", "|---|---:|---:|---:|"], rows)
    rows = []
    for name in strategies:
        pairs = _pairs(runs, "picker", name) if name != "picker" else []
        if pairs:
            cells = _paired_cells(pairs)
            lower = [sum(mine[f] < theirs[f] for mine, theirs in pairs) for f in ("ttft_mean_ms", "ttft_p90_ms")]
            rows.append(f"| {name} | {len(pairs)} | {cells[0]} | {cells[1]} | {lower[0]} / {lower[1]} |")
    return lines + _table_section(
        "The picker against each router, repeat by repeat",
        "The picker's figure over the other router's in the same repeat: median (range) over the repeats, and in how "
        "many repeats the picker's was the lower.",
        ["| router | repeats | picker's TTFT mean / its | picker's p90 / its | picker lower: mean / p90 |",
         "|---|---:|---:|---:|---:|"], rows)


class PhaseFigures(NamedTuple):
    """A pool-change run, phase by phase: before the leave, while one server served alone, after the join."""

    means_ms: tuple[float, float, float]  # TTFT mean of the requests sent in each phase
    joined_share: float  # the joined server's share of the requests sent after it joined
    slowest: tuple[int, int, int]  # the run's slowest tenth (TTFT at or above its p90) by the phase it was sent in


def phase_figures(run: dict[str, Any]) -> PhaseFigures | None:
    """A pool-change run's figures by phase; None for other runs. Where the slowest tenth was sent says which
    phase sets the run's p90: a router can only change it where it has a choice (not while one server is alone)."""
    events = dict(run.get("pool_changes") or [])
    rows = run.get("requests_detail") or []
    if "left" not in events or "joined" not in events or not rows:
        return None
    phases: list[list[float]] = [[], [], []]
    for row in rows:
        phases[0 if row[0] < events["left"] else 1 if row[0] < events["joined"] else 2].append(row[5])
    means = [statistics.fmean(p) if p else math.nan for p in phases]
    joined = run["share"][-1] * run["completed"] / len(phases[2]) if phases[2] else math.nan
    p90 = percentile(np.array([row[5] for row in rows]), 90)
    slow = [sum(t >= p90 for t in p) for p in phases]
    return PhaseFigures((means[0], means[1], means[2]), joined, (slow[0], slow[1], slow[2]))


def phase_lines(runs: list[dict[str, Any]], strategies: list[str]) -> list[str]:
    """The report's section on a pool change, phase by phase (medians over the repeats): for every router, the peers
    included (it needs no pod per request: the joined server's share is its own request counter)."""
    rows = []
    for name in strategies:
        figures = [f for r in runs if r["strategy"] == name and "error" not in r
                   for f in [phase_figures(r)] if f is not None]
        if figures:
            means = [statistics.median(f.means_ms[i] for f in figures) for i in range(3)]
            share = statistics.median(f.joined_share for f in figures)
            slow = " / ".join(f"{statistics.median(f.slowest[i] for f in figures):g}" for i in range(3))
            rows.append(f"| {name} | {len(figures)} | {means[0]:.1f} | {means[1]:.1f} | {means[2]:.1f} | {share:.2f} "
                        f"| {slow} |")
    return _table_section(
        "Phase by phase of the pool change",
        "TTFT mean of the requests sent before the leave, while one server served alone (from the leave to the join) "
        "and after the join, the share of the requests sent after the join that the joined server served, and where "
        "the run's slowest tenth (TTFT at or above its p90) was sent: medians over the repeats. While one server is "
        "alone no router has a choice.",
        ["| router | runs | before the leave ms | one server ms | after the join ms | joined server's share after "
         "| slowest tenth: before / alone / after |",
         "|---|---:|---:|---:|---:|---:|---|"], rows)


def busier_pick_lines(runs: list[dict[str, Any]], strategies: list[str]) -> list[str]:
    """The report's section on `busier_picks`, per repeat; empty for runs recorded without per-request rows."""
    rows = []
    for name in strategies:
        counts = [busier_picks(r["requests_detail"]) for r in detailed_runs(runs, name)]
        if counts:
            rows.append(f"| {name} | {', '.join(f'{b} of {n}' for n, b in counts)} |")
    return _table_section(
        "Picks onto a pod still busier with prefills",
        "Per repeat: requests sent to a pod with more requests awaiting their first token than another pod had at "
        "that moment (a request sent during another's prefill waits for it).",
        ["| router | picks onto the busier pod, per repeat |", "|---|---|"], rows)


def cross_pod_lines(runs: list[dict[str, Any]], strategies: list[str]) -> list[str]:
    """The report's section on how much a cold prefill on one server slows the other's warm requests (pooled over
    repeats); empty for runs recorded without per-request rows."""
    rows = []
    for name in strategies:
        got: dict[str, list[float]] = {"clear": [], "other_cold": []}
        for r in detailed_runs(runs, name):
            for k, v in cross_pod_warm(r["requests_detail"]).items():
                got[k] += v
        if not got["clear"] or not got["other_cold"]:
            continue
        clear, other = statistics.fmean(got["clear"]), statistics.fmean(got["other_cold"])
        rows.append(f"| {name} | {len(got['clear'])}, {clear:.0f} | {len(got['other_cold'])}, {other:.0f} | "
                    f"{other / clear:.2f}x |")
    return _table_section(
        "Do the servers slow each other? (pooled over repeats)",
        "Warm requests that no cold prefill on their own pod delayed, by whether another pod was prefilling a cold "
        "request while they waited for their first token. The servers here share the machine's cores and memory "
        "bandwidth; pods with an accelerator each would not slow each other. A correlation, not a controlled "
        "measurement: a burst of arrivals also loads both pods at once.",
        ["| router | other pods clear: n, TTFT mean ms | another pod prefilling cold: n, TTFT mean ms | ratio |",
         "|---|---|---|---:|"], rows)


def first_placement_lines(runs: list[dict[str, Any]], strategies: list[str]) -> list[str]:
    """The report's section on where each router sent the groups' first requests (pooled over repeats); empty for
    runs recorded without per-request rows and for runs whose pool changed (a pod that has left or not yet joined
    would count as the lightest)."""
    rows = []
    for name in strategies:
        got = [p for r in detailed_runs(runs, name) if not r.get("pool_changes")
               for p in first_placements(r["requests_detail"], len(r["share"]))]
        if not got:
            continue
        clear = [ttft for ahead, _o, _j, ttft in got if ahead == 0]
        rows.append(
            f"| {name} | {len(got)} | {statistics.fmean(p[0] for p in got):.0f} / "
            f"{statistics.fmean(p[1] for p in got):.0f} | {sum(p[0] > p[1] for p in got)} / "
            f"{sum(p[0] < p[1] for p in got)} | {statistics.fmean(p[2] for p in got):.2f} | "
            f"{statistics.fmean(p[3] for p in got):.0f} | "
            f"{len(clear)}, {statistics.fmean(clear) if clear else math.nan:.0f} |")
    return _table_section(
        "Where the first requests went (pooled over repeats)",
        "A group's first request is cold under every router; what a router decides is the pod it waits on. "
        "Prefilling ahead: uncached prompt tokens of requests sent before it that had not yet had their first "
        "token, on the pod it went to and on the lightest other pod. Joined: requests that reached its pod while it "
        "prefilled.",
        ["| router | first requests | prefilling ahead: chosen / lightest other (mean tokens) | "
         "chose a pod with more / less ahead | joined while prefilling (mean) | TTFT mean ms | "
         "nothing ahead: n, TTFT mean ms |",
         "|---|---:|---|---|---:|---:|---|"], rows)


def mean_without_avoidable_colds(rows: list[list[float]]) -> float:
    """The run's TTFT mean had every cold request other than its group's first (copies, evictions) taken the run's
    mean warm TTFT instead: what better placement alone could have bought, the pods' queues left as they were."""
    kinds = cold_kinds(rows)
    warm = [row[5] for row, kind in zip(rows, kinds, strict=True) if kind == "warm"]
    first = [row[5] for row, kind in zip(rows, kinds, strict=True) if kind == "first"]
    if not warm:
        return math.nan
    avoidable = len(rows) - len(warm) - len(first)
    return (sum(first) + sum(warm) + avoidable * statistics.fmean(warm)) / len(rows)


def held_medians(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Medians over `runs` of what Envoy held their requests and responses (p50, p90 ms); empty for runs recorded
    before Envoy timed each request."""
    timed = [r for r in runs if "request_held_ms" in r]
    return {key: [statistics.median(r[key][i] for r in timed) for i in (0, 1)]
            for key in ("request_held_ms", "response_held_ms")} if timed else {}


def detailed_runs(runs: list[dict[str, Any]], strategy: str) -> list[dict[str, Any]]:
    """`strategy`'s runs that recorded per-request rows with the pod that served each (runs made before they were
    kept have none; a peer router's rows name no pod)."""
    return [r for r in runs if r["strategy"] == strategy and r.get("requests_detail") and r.get("pods_known", True)]


def where_ttft_goes(runs: list[dict[str, Any]], strategies: list[str]) -> list[str]:
    """The report's section on cold causes and TTFT by class (medians over each router's repeats); empty for runs
    recorded without per-request rows."""
    rows = []
    for name in strategies:
        mine = detailed_runs(runs, name)
        if not mine:
            continue
        parts = [ttft_breakdown(r["requests_detail"]) for r in mine]
        cells = []
        for cls in ("cold", "warm_behind_cold", "warm_clear"):
            n, mean, share = (statistics.median(p[cls][k] for p in parts) for k in ("n", "mean_ms", "share"))
            cells.append(f"{n:g}, {mean:.0f}, {share:.0%}")
        causes = " / ".join(f"{statistics.median(r['cold_causes'][k] for r in mine):g}"
                            for k in ("first", "copy", "evicted"))
        groups = ", ".join("/".join(map(str, r["groups_per_pod"])) for r in mine)
        mean = statistics.median(r["ttft_mean_ms"] for r in mine)
        bound = statistics.median(mean_without_avoidable_colds(r["requests_detail"]) for r in mine)
        rows.append(f"| {name} | {groups} | {causes} | {' | '.join(cells)} | {mean:.1f} | {bound:.1f} |")
    return _table_section(
        "Where the time to first token goes (medians over repeats)",
        "Cold: under half the prompt from cache, by cause (first of its group / group moved to another pod / "
        "dropped by the pod's cache). Warm behind cold: sent while a cold request on the same pod still awaited its "
        "first token. Without avoidable colds: the mean had every cold request but its group's first taken the "
        "run's mean warm TTFT (what placement alone could still buy).",
        ["| router | groups per pod | cold: first / copy / evicted | cold: n, mean ms, share of TTFT | "
         "warm behind cold | other warm | TTFT mean | without avoidable colds |",
         "|---|---|---|---|---|---|---:|---:|"], rows)


def _table_section(title: str, intro: str, header: list[str], rows: list[str]) -> list[str]:
    """A report section of per-request analysis: its title, what it counts, the table; left out (empty) when no
    router has a row (runs recorded without per-request rows)."""
    return ["", f"## {title}", "", intro, "", *header, *rows] if rows else []
