"""The real-engine benchmark's vocabulary: the routers it knows, each workload's shape (RealSpec) and the trace a
workload makes (shared-prefix prompts with Poisson arrivals, or conversations sent turn after turn)."""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from picker_lab.bench import vllm_engine as engine
from picker_lab.bench.peers import PEERS
from picker_lab.bench.workloads import group_sizes
from picker_lab.sim.info_routes import NAMED_SCRAPE_SHARE

STRATEGIES = ("round-robin", "hash-ring", "bounded-load", "prefix-hash", "picker", "picker-predicted-ttft",
              "picker-4-replicas", "picker-round-robin", "picker-candidate", *PEERS)
# What `make bench-real` compares: round-robin, the two strong hash baselines and the defaults.
DEFAULT_STRATEGIES = ("round-robin", "hash-ring", "bounded-load", "picker")
# What the hash baselines read: nothing but liveness, so its scrapes are kept to a health check.
HEALTH_ONLY_INTERVAL = "5s"
# vLLM 0.32 answers its render endpoints (prompt -> token ids, what vllm-router's cache_aware policy routes on) with
# 403 unless started with this; it adds routes, nothing on the request path of the other routers.
SERVER_FLAGS = ["--enable-scale-out"]
# API-server CPU one /metrics scrape costs vLLM 0.32 on the CPU (bench/scrape_cost.py: 6.7-6.8 ms idle, 4.2-7.7 ms
# under traffic), for the simulator's mirror of this benchmark.
SCRAPE_COST_S = 0.006


# Each workload's shape, as RealSpec fields; what is not named takes RealSpec's default (`uniform`). A KV block
# holds 64 tokens: a 768-token prefix is 12 blocks, 160 blocks per server.
REAL_WORKLOADS: dict[str, dict[str, Any]] = {
    # 20 prefixes = 240 blocks: the fleet's caches hold them all, one server's does not
    "uniform": {},
    # 24 prefixes = 288 of the fleet's 320 blocks: they fit only if no prefix is held twice. Every miss is a cold
    # 768-token prefill (4.1 s on the 2026-12-03 machine): 2 req/s overloaded both servers (hash ring 19 s mean), 1
    # req/s keeps them busy but not past saturation
    "pressure": {"groups": 24, "prompts_per_group": 10, "rate": 1.0},
    # 4 prefixes (48 blocks) that every server holds easily, one of them carrying over half the traffic, at a rate
    # one server cannot carry alone: with Envoy, router and client sharing their two cores, the two servers here
    # were saturated at 2.4 req/s (round-robin p90 3.6 s), so one carries at most ~1.2
    "hot": {"groups": 4, "prompts_per_group": 60, "group_weights": (0.55, 0.25, 0.1, 0.1), "rate": 1.7},
    # 30 conversations of 6 turns, each growing to ~1,100 tokens (17 blocks), a 3 s pause between an answer and the
    # next turn: ~6 live at a time, whose contexts fit the caches
    "multi-turn": {"groups": 30, "turns": 6, "system_tokens": 512, "question_tokens": 64, "output_tokens": 32,
                   "think_s": 3.0, "rate": 1.2},
    # 12 prefixes (144 blocks: one server holds them all) at a rate one server carries alone (the hot workload's
    # limit is ~1.2 req/s); the second server leaves at 30 % of the run and a fresh one (empty cache, a new address)
    # joins at 60 %: a rolling restart (lab/picker_lab/bench/membership.py). Round-robin's Envoy has a static cluster that
    # cannot follow the change; the pickers read an endpoints file, the peers get their add/remove-worker calls.
    "leave-rejoin": {"groups": 12, "prompts_per_group": 17, "rate": 1.0, "leave_at": 0.3, "rejoin_at": 0.6,
                     "strategies": ("hash-ring", "bounded-load", "picker")},
}


@dataclass(frozen=True)
class RealSpec:
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    workload: str = "uniform"
    repeats: int = 3
    servers: int = 2
    groups: int = 20
    prompts_per_group: int = 12
    system_tokens: int = 768
    question_tokens: int = 64
    output_tokens: int = 16
    rate: float = 2.0
    group_weights: tuple[float, ...] = ()  # popularity per group (same total); empty: all alike
    turns: int = 0  # > 0: `groups` conversations of this many turns instead of shared prefixes
    think_s: float = 1.0  # conversations: mean pause between an answer and the next turn
    block_size: int = 64
    num_blocks: int = 160
    seed: int = 1
    picker_args: tuple[str, ...] = ()  # extra `picker serve` flags for the picker strategies
    candidate_args: tuple[str, ...] = ()  # and for `picker-candidate` only, after those
    model: str = "small"  # the served model's shape: vllm_engine.MODEL_SHAPES
    leave_at: float = 0.0  # > 0: the last server leaves at this share of the trace's span ...
    rejoin_at: float = 0.0  # ... and a fresh server joins at this one
    # True: one set of servers for every run, their prefix caches emptied between runs (vLLM's reset endpoint)
    # instead of fresh servers: ~3x the runs in the same time, every router on the same processes
    reuse_servers: bool = False
    # True: repeat r replays the trace of seed + r. Fresh servers listen on new ports, so the hash routers throw
    # their placement dice anew each repeat; reused ones keep their ports, and one trace would measure a hash on
    # one placement of its prefixes however many repeats ran (set with reuse_servers by `picker bench`)
    seed_per_repeat: bool = False
    # True: the routers behind our Envoy asked vLLM for only the series they read (`--metrics-only-read-series`,
    # every run since 2026-12-06), so the mirror prices their scrapes at NAMED_SCRAPE_SHARE of a whole page's;
    # a run recorded without the key scraped whole pages (`recorded`)
    series_filter: bool = True

    @property
    def scrape_cost_s(self) -> float:
        """API-server CPU one of this run's scrapes cost a pod, as the mirror prices it."""
        return SCRAPE_COST_S * (NAMED_SCRAPE_SHARE if self.series_filter else 1.0)

    def trace_seed(self, repeat: int) -> int:
        """The seed of repeat `repeat`'s trace (0-based; settling passes, numbered below 0, replay repeat 0's)."""
        return self.seed + max(repeat, 0) if self.seed_per_repeat else self.seed

    @property
    def requests(self) -> int:
        return self.groups * (self.turns or self.prompts_per_group)

    @classmethod
    def for_workload(cls, workload: str, **given: Any) -> RealSpec:
        """The spec of a named workload (REAL_WORKLOADS), `given` fields on top."""
        if workload not in REAL_WORKLOADS:
            raise ValueError(f"unknown workload {workload!r} for --engine vllm (known: {', '.join(REAL_WORKLOADS)})")
        return cls(workload=workload, **{**REAL_WORKLOADS[workload], **given})

    def with_requests(self, requests: int) -> RealSpec:
        """The same workload with about `requests` requests: more prompts per shared prefix at the same popularity,
        so a faster machine can be loaded at a higher rate for as long as a slower one at the preset's."""
        if self.turns:
            raise ValueError(f"--requests: the {self.workload} workload is {self.groups} conversations of "
                             f"{self.turns} turns; scale it with --rate")
        if requests < self.groups:
            raise ValueError(f"--requests: at least one per group ({self.groups})")
        return replace(self, prompts_per_group=round(requests / self.groups))

    @classmethod
    def recorded(cls, spec: dict[str, Any]) -> RealSpec:
        """The spec as a run's real.json holds it (lists back to tuples, derived keys such as `requests` dropped)."""
        names = {f.name for f in fields(cls)}
        given: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items() if k in names}
        return cls(**{"series_filter": False, **given})  # recorded before the filter: whole pages


# --- the workload -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """One request. A conversation's later turns (`turn` > 0) are sent `at` seconds after the previous turn's
    answer, their prompt appended to the conversation so far (its prompts and answers); the rest `at` seconds
    after the start."""

    at: float
    group: int  # the shared prefix's group, or the conversation
    prompt: str
    turn: int = 0


def build_trace(spec: RealSpec, tokens_per_word: float, repeat: int = 0) -> list[Request]:
    """Shared-prefix prompts in a seeded random order with Poisson arrivals, or conversations (`turns` > 0); the
    seed is repeat `repeat`'s (RealSpec.trace_seed)."""
    rng = random.Random(spec.trace_seed(repeat))
    words = engine.vocabulary()

    def text(tokens: int) -> str:
        return " ".join(rng.choice(words) for _ in range(max(1, round(tokens / tokens_per_word))))

    if spec.turns:
        return conversations(spec, text, rng)
    systems = [text(spec.system_tokens) for _ in range(spec.groups)]
    sizes = group_sizes(spec.groups, spec.prompts_per_group, spec.group_weights)
    pairs = [(g, text(spec.question_tokens)) for g in range(spec.groups) for _ in range(sizes[g])]
    rng.shuffle(pairs)
    at = 0.0
    out = []
    for g, question in pairs:
        at += rng.expovariate(spec.rate)
        out.append(Request(at, g, f"{systems[g]}\n\nQuestion: {question}\nAnswer:"))
    return out


def tokens_per_word(url: str) -> float:
    """Calibrate word counts to token counts with the server's own tokenizer (/tokenize)."""
    rng = random.Random(99)
    words = engine.vocabulary()
    sample = " ".join(rng.choice(words) for _ in range(2000))
    body = json.dumps({"model": engine.MODEL_NAME, "prompt": sample, "add_special_tokens": False}).encode()
    req = urllib.request.Request(url + "/tokenize", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return float(json.load(resp)["count"]) / 2000


def conversations(spec: RealSpec, text: Callable[[int], str], rng: random.Random) -> list[Request]:
    """`groups` conversations of `turns` turns, starting with Poisson arrivals at `rate / turns` (about `rate`
    requests/s in all): a first message of `system_tokens` of its own, then `question_tokens` per turn, each sent
    an exponential think time (mean `think_s`) after the previous answer. Sized so the live conversations'
    contexts fit the caches: a working set larger than them defeats every router."""
    out: list[Request] = []
    start = 0.0
    for c in range(spec.groups):
        start += rng.expovariate(spec.rate / spec.turns)
        out.append(Request(start, c, f"{text(spec.system_tokens)}\n\nUser: {text(spec.question_tokens)}\nAssistant:"))
        out += [Request(rng.expovariate(1.0 / spec.think_s), c, f"\n\nUser: {text(spec.question_tokens)}\nAssistant:",
                        turn) for turn in range(1, spec.turns)]
    return out


def chains(trace: list[Request]) -> list[list[Request]]:
    """The trace as sequences sent one after another: a conversation's turns, or one request alone."""
    out: list[list[Request]] = []
    for r in trace:
        if r.turn:
            out[-1].append(r)
        else:
            out.append([r])
    return out
