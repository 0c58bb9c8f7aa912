"""Explore the full picker's scheduling weights in fast mode: each variant replays the same seeded traces as the
defaults and round-robin, side by side, so a tuning change shows its effect on every workload at once.

    .venv/bin/python bench/run_scheduling_sweep.py [--workloads chat,code,...] [--requests 3000] [--load 0.8]

Variants are GIE-shaped `scheduling` config overrides (what `picker serve --config-file` takes under
`scheduling:`); the defaults live in picker/scheduling/config.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from picker.scheduling.config import DEFAULT_CONFIG  # noqa: E402
from picker_lab.bench.configs import PREDICTED_TTFT_CONFIG, predicted_ttft_scheduling, with_scorer  # noqa: E402
from picker_lab.bench.suite import Cell, FastSpec, calibrate, run_cell  # noqa: E402


def _with_weights(profile: str, weights: Mapping[str, float]) -> dict[str, Any]:
    """Defaults with some scorer weights of one profile changed."""
    cfg = copy.deepcopy(DEFAULT_CONFIG)
    for p in cfg["schedulingProfiles"]:
        if p["name"] == profile:
            for ref in p["plugins"]:
                if ref.get("pluginRef") in weights:
                    ref["weight"] = weights[ref["pluginRef"]]
    return {"schedulingProfiles": cfg["schedulingProfiles"]}


def _with_params(plugin: str, params: dict[str, Any]) -> dict[str, Any]:
    cfg = copy.deepcopy(DEFAULT_CONFIG)
    for spec in cfg["plugins"]:
        if spec["name"] == plugin:
            spec.setdefault("parameters", {}).update(params)
    return {"plugins": cfg["plugins"]}


def _combine(*parts: dict[str, Any]) -> dict[str, Any]:
    """Merge partial configs that touch different top-level keys (plugins / schedulingProfiles)."""
    out: dict[str, Any] = {}
    for part in parts:
        out.update(part)
    return out


_FIRST_WEIGHTS = {"prefix-cache-scorer": 1, "queue-scorer": 2, "kv-cache-utilization-scorer": 2}
_NO_PREFILL = {"prefillHalfLife": 0.0}

VARIANTS: dict[str, dict[str, Any] | None] = {
    "defaults": None,
    # The first defaults, and each of the two changes that replaced them (bench/studies/published-table.md, "How the defaults
    # were chosen").
    "first defaults": _combine(_with_weights("bursty-chat", _FIRST_WEIGHTS),
                               _with_params("in-flight-load-scorer", _NO_PREFILL)),
    "first + chat prefix 3 queue 1 kv 1": _with_params("in-flight-load-scorer", _NO_PREFILL),
    "first + recent prefill": _with_weights("bursty-chat", _FIRST_WEIGHTS),
    "chat: queue 0 kv 0": _with_weights("bursty-chat", {"queue-scorer": 0, "kv-cache-utilization-scorer": 0}),
    "always context-heavy": _with_params("request-classifier", {"longPromptChars": 0}),
    "chat: in-flight 8": _with_weights("bursty-chat", {"in-flight-load-scorer": 8}),
    # the in-flight guard the defaults had before (docs/decisions.md)
    "prefix guard: in-flight 8 too": _with_params("prefix-cache-scorer", {"loadGuardInFlight": 8}),
    "prefix guard 16/8": _with_params("prefix-cache-scorer", {"loadGuardInFlight": 16, "loadGuardWaiting": 8}),
    "prefix guard 4/2": _with_params("prefix-cache-scorer", {"loadGuardInFlight": 4, "loadGuardWaiting": 2}),
    # What 4 replicas hinted (bench/studies/replicas.md, "Several picker replicas"): in-flight load weighed less.
    "in-flight slack 4": _with_params("in-flight-load-scorer", {"slack": 4.0}),
    "in-flight slack 2": _with_params("in-flight-load-scorer", {"slack": 2.0}),
    "context-heavy: in-flight 0.5": _with_weights("context-heavy", {"in-flight-load-scorer": 0.5}),
    # code's one loss to GIE's emulation (prefix weighed higher there): more prefix or less in-flight for chat?
    "chat: prefix 4": _with_weights("bursty-chat", {"prefix-cache-scorer": 4}),
    "chat: in-flight 2": _with_weights("bursty-chat", {"in-flight-load-scorer": 2}),
    # cold prompts that land on a pod which has just taken another cold prompt (the long-prompt workloads' p99,
    # see docs/decisions.md): the deal by recency alone, or a recent prefill counted heavier
    "cold spreader: recency only": _with_params("cold-prefix-spreader", {"recencyWeight": 1.0}),
    # the deal by recency and count: recency and in-flight counts half and half, not the uncached prefill each pod
    # was handed, weighed 1 in bursty-chat
    "deal by recency and count": _combine(
        _with_params("cold-prefix-spreader", {"workTokens": 0, "recencyWeight": 0.5}),
        _with_weights("bursty-chat", {"cold-prefix-spreader": 1})),
    # the deal weighed 2 in chat: weighed 2 in bursty-chat, against the in-flight scorer's 3 (its other change,
    # a pod's scraped queue counted when longer than our own count, never fires with one picker in fast mode)
    "deal weighed 2 in chat": _with_weights("bursty-chat", {"cold-prefix-spreader": 2}),
    # the deal yields to any held opening: it stood aside whenever the pods held different amounts of a prompt, however
    # little of it (a system prompt some pods hold before a long cold question)
    "deal yields to any held opening": _with_params("cold-prefix-spreader", {"standAsideShare": 0.0}),
    "prefill weight 16": _with_params("in-flight-load-scorer", {"prefillWeight": 16}),
    "prefill weight 64": _with_params("in-flight-load-scorer", {"prefillWeight": 64}),
    # ...or the predicted-TTFT scorer (its queue of our own picks drains at the pods' measured prefill rate) on top
    "predicted-ttft 8 on top": with_scorer(DEFAULT_CONFIG, "predicted-ttft-scorer", 8),
    # GIE's default scheduling, emulated with our plugins: queue 2, kv-cache 2, prefix 3 (matched/total only, no
    # load guard), max score with random tie-break, one profile; same prefix hashing (64-character blocks) and
    # per-pod LRU. Not GIE's code: its Go picker does not run here.
    "GIE defaults (emulated)": {
        "plugins": [
            {"type": "prefix-cache-scorer", "name": "prefix-cache-scorer",
             "parameters": {"ratioWeight": 1.0, "loadGuardInFlight": None, "loadGuardWaiting": None}},
            {"type": "kv-cache-utilization-scorer", "name": "kv-cache-utilization-scorer"},
            {"type": "queue-scorer", "name": "queue-scorer"},
            {"type": "max-score-picker", "name": "max-score-picker"},
        ],
        "schedulingProfiles": [{"name": "default", "plugins": [
            {"pluginRef": "prefix-cache-scorer", "weight": 3},
            {"pluginRef": "queue-scorer", "weight": 2},
            {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
            {"pluginRef": "max-score-picker"},
        ]}],
    },
}


def predicted_ttft(load_weight: float = 0.001, **params: Any) -> dict[str, Any]:
    """PREDICTED_TTFT_CONFIG with the predicted-ttft-scorer's `params` and the in-flight tie-break's weight."""
    cfg = predicted_ttft_scheduling(**params)
    for ref in cfg["schedulingProfiles"][0]["plugins"]:
        if ref.get("pluginRef") == "in-flight-load-scorer":
            ref["weight"] = load_weight
    return cfg


# Predicted TTFT (picker/scheduling/predicted.py): the minimum predicted time to first token; prefix and load
# scorers with small weights only break its ties. Its decode and tie-break settings, varied:
VARIANTS["predicted-ttft"] = predicted_ttft()
VARIANTS["predicted-ttft decode 0"] = predicted_ttft(decodeTokens=0)
VARIANTS["predicted-ttft decode 32"] = predicted_ttft(decodeTokens=32)
VARIANTS["predicted-ttft per-pod rate"] = predicted_ttft(perPodRate=True)
# The first predicted-TTFT model: a cost per token alone (no fixed cost per prefill, no eviction price, no copy
# demand), 10,000 tokens/s, decode 8; and today's without the eviction price, or without copy demand.
VARIANTS["predicted-ttft per-token only"] = predicted_ttft(prefillFixedSeconds=0.0, prefillTokensPerSecond=10_000,
                                                           decodeTokens=8, evictionCost=0.0, demandWindowSeconds=0.0)
VARIANTS["predicted-ttft no eviction price"] = predicted_ttft(evictionCost=0.0)
VARIANTS["predicted-ttft no copy demand"] = predicted_ttft(demandWindowSeconds=0.0)


def hybrid() -> dict[str, Any]:
    """The defaults with the context-heavy profile (long prompts, long cached prefixes) replaced by
    PREDICTED_TTFT_CONFIG's: short prompts keep the weighted scorers."""
    cfg = copy.deepcopy(DEFAULT_CONFIG)
    cfg["plugins"].insert(0, {"type": "predicted-ttft-scorer", "name": "predicted-ttft-scorer"})
    for p in cfg["schedulingProfiles"]:
        if p["name"] == "context-heavy":
            p["plugins"] = copy.deepcopy(PREDICTED_TTFT_CONFIG["schedulingProfiles"][0]["plugins"])
    return {"plugins": cfg["plugins"], "schedulingProfiles": cfg["schedulingProfiles"]}


VARIANTS["hybrid: long prompts predicted"] = hybrid()
BASELINES = ("round-robin", "prefix-hash")


def scheduling_spec(cfg: dict[str, Any] | None) -> str:
    """A variant's config as FastSpec carries it ("": the defaults)."""
    return json.dumps(cfg) if cfg else ""


def _run(args: tuple[FastSpec, Cell]) -> dict[str, Any]:
    return run_cell(*args)["figures"]


def sweep(base: FastSpec, variants: list[str], variant_configs: Mapping[str, dict[str, Any] | None] | None = None,
          ) -> dict[tuple[str, str], dict[str, Any]]:
    """Figures of every (variant, workload) and of the baselines, the same traces for all, on every core.
    `variant_configs` adds variants beyond VARIANTS."""
    configs = {**VARIANTS, **(variant_configs or {})}
    cal = calibrate(base)
    jobs: list[tuple[str, str, tuple[FastSpec, Cell]]] = []
    for w in base.workloads:
        c = cal[w]
        for baseline in BASELINES:
            jobs.append((baseline, w, (base, Cell("main", w, baseline, base.requests, c["rate_rps"], c["load"],
                                                  base.pods))))
        for name in variants:
            spec = FastSpec(**{**base.__dict__, "scheduling": scheduling_spec(configs[name])})
            jobs.append((name, w, (spec, Cell("main", w, "picker", base.requests, c["rate_rps"], c["load"],
                                              base.pods))))
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(_run, [j[2] for j in jobs]))
    return {(j[0], j[1]): r for j, r in zip(jobs, results, strict=True)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="chat,code,multi-turn,summarize,shared-prefix,bursty,hot-prefix")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variant names")
    parser.add_argument("--out", default=None, help="write the table (markdown) and raw JSON here")
    args = parser.parse_args()
    workloads = tuple(w for w in args.workloads.split(",") if w)
    base = FastSpec(pods=args.pods, workloads=workloads, load=args.load, requests=args.requests, seed=args.seed,
                    sweep_workloads=(), capacity_workload=None)
    rows = sweep(base, args.variants.split(","))
    lines = [f"Fast mode, {args.pods} pods, load {args.load}, {args.requests} requests, seed {args.seed}. "
             "Cells: TTFT mean / p90 / p95 / p99 ms, hit rate, share served cold (oracle's).", "",
             "| variant | " + " | ".join(workloads) + " |", "|---|" + "---|" * len(workloads)]
    for name in [*BASELINES, *args.variants.split(",")]:
        cells = []
        for w in workloads:
            f = rows[(name, w)]
            cells.append(f"{f['ttft_mean'] * 1e3:.1f} / {f['ttft_p90'] * 1e3:.1f} / {f['ttft_p95'] * 1e3:.1f} / "
                         f"{f['ttft_p99'] * 1e3:.1f}, "
                         f"{f['hit_rate'] * 100:.0f}%, cold {f['cold_share'] * 100:.0f}% ({f['oracle_cold_share'] * 100:.0f}%)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "scheduling_sweep.md").write_text(text + "\n")
        (out / "scheduling_sweep.json").write_text(json.dumps(
            {"variants": {k: v for k, v in VARIANTS.items()}, "rows": [
                {"variant": k[0], "workload": k[1], **v} for k, v in rows.items()]}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
