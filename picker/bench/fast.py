"""Fast mode: a discrete-event simulation of a whole fleet routed by one scheduler, in simulated time.

No network, no asyncio: simulated vLLM engines (`picker.sim.engine.Engine`) are stepped from one event heap, and
the scheduler under test is the same object `picker serve` runs. It sees endpoints the way the live picker does:
metrics refreshed by a scrape every `scrape_interval` of simulated time (waiting, running, kv_usage, cache
config) and its own in-flight counts, moved at pick and at the end of the response.

Events, in time order (ties: deliveries, then arrivals, then steps, then scrapes):
- arrival: build the request (a follow-up gets its parent's answer), admit, schedule, add it to the pod;
- step: the pod runs one batch; its outputs are delivered when the batch ends;
- deliver: first tokens, finished requests (in-flight released, follow-ups scheduled);
- scrape: refresh every endpoint's metrics; every `sample_interval` also record per-pod load.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from picker.admission import AdmissionController
from picker.bench.oracle import InfiniteCacheOracle
from picker.bench.prompts import PromptBuilder, prompt_text
from picker.bench.results import OK, SHED, RunResult
from picker.bench.trace import Message, Trace
from picker.endpoints.state import Endpoint
from picker.requests import ApiKind, InferenceRequest, RequestError, estimated_tokens
from picker.scheduling.config import build_strategy
from picker.scheduling.types import Scheduler
from picker.sim.engine import Engine, SimRequest, StepResult
from picker.sim.profiles import Profile

_DELIVER, _ARRIVE, _STEP, _SCRAPE = 0, 1, 2, 3
Progress = Callable[[int], None]


@dataclass(frozen=True)
class FastConfig:
    """The simulated fleet and how the picker observes it."""

    profile: Profile
    pods: int
    seed: int = 0
    scrape_interval: float = 0.05  # picker's --refresh-metrics-interval
    sample_interval: float = 1.0  # per-pod load time series
    prefix_caching: bool = True
    admission: bool = True  # run the picker's admission check (the Envoy-only baseline has none)


def make_scheduler(strategy: str, seed: int, scheduling: Mapping[str, Any] | None = None) -> Scheduler:
    """The scheduler `picker serve --strategy` would run (scheduling config only applies to the full picker)."""
    config = scheduling if strategy == "picker" else None
    return build_strategy(strategy, config=config, rng=random.Random(seed))


def run_fast(trace: Trace, strategy: str, cfg: FastConfig, *, scheduling: Mapping[str, Any] | None = None,
             progress: Progress | None = None) -> RunResult:
    """Replay `trace` on a fresh simulated fleet routed by `strategy`; returns every measurement."""
    return _FastRun(trace, strategy, cfg, scheduling, progress).run()


class _FastRun:
    """State of one replay; `run()` drains the event heap."""

    def __init__(self, trace: Trace, strategy: str, cfg: FastConfig, scheduling: Mapping[str, Any] | None,
                 progress: Progress | None) -> None:
        self.trace = trace
        self.cfg = cfg
        self.progress = progress
        profile = cfg.profile
        self.res = RunResult("fast", trace.workload, strategy, cfg.pods, len(trace))
        self.res.allocate()
        self.engines = [Engine(profile, seed=cfg.seed, enable_prefix_caching=cfg.prefix_caching)
                        for _ in range(cfg.pods)]
        self.endpoints = [Endpoint.from_address(f"10.0.{k // 250}.{k % 250 + 1}:8000", name=f"pod-{k}")
                          for k in range(cfg.pods)]
        self.pod_of = {ep.address: k for k, ep in enumerate(self.endpoints)}
        for ep in self.endpoints:
            ep.metrics.block_size = profile.block_size
            ep.metrics.num_gpu_blocks = profile.num_gpu_blocks
        self.scheduler = make_scheduler(strategy, cfg.seed, scheduling)
        self.admission = AdmissionController() if cfg.admission and strategy != "round-robin" else None
        self.builder = PromptBuilder(self.engines[0].tokenizer)
        self.oracle = InfiniteCacheOracle(profile.block_size)
        self.children = trace.children()
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.scheduled = [False] * cfg.pods
        self.busy = [0.0] * cfg.pods
        self.served = [0] * cfg.pods
        self.history: dict[int, tuple[Message, ...]] = {}  # full messages (+ answer) of requests with follow-ups
        self.live: dict[int, tuple[list[int], list[int], int]] = {}  # index -> (prompt ids, oracle hashes, tokens)
        self.first_token: dict[int, float] = {}
        self.outstanding = len(trace)
        self.unreported = 0
        self.last_event = 0.0

    def push(self, t: float, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, payload))

    def run(self) -> RunResult:
        wall0 = time.perf_counter()
        for r in self.trace.requests:
            if r.parent < 0:
                self.push(r.at, _ARRIVE, r.index)
        self.push(0.0, _SCRAPE, 0)
        heap = self.heap
        pop = heapq.heappop
        while heap:
            now, kind, _, payload = pop(heap)
            if kind == _STEP:
                self.step(payload, now)
            elif kind == _DELIVER:
                self.deliver(payload[0], payload[1], now)
            elif kind == _ARRIVE:
                self.arrive(payload, now)
            else:
                self.scrape(payload, now)
                continue
            self.last_event = now
        if self.progress is not None and self.unreported:
            self.progress(self.unreported)
        return self.finish_result(time.perf_counter() - wall0)

    def wake(self, k: int, now: float) -> None:
        if not self.scheduled[k]:
            nxt = self.engines[k].next_step_time()
            if nxt is not None:
                self.scheduled[k] = True
                self.push(max(nxt, now), _STEP, k)

    def step(self, k: int, now: float) -> None:
        self.scheduled[k] = False
        result = self.engines[k].step(now)
        self.busy[k] += result.duration
        self.push(result.end, _DELIVER, (k, result))
        self.wake(k, result.end)

    def done(self) -> None:
        self.outstanding -= 1
        self.unreported += 1
        if self.progress is not None and self.unreported >= 500:
            self.progress(self.unreported)
            self.unreported = 0

    def arrive(self, i: int, now: float) -> None:
        r = self.trace.requests[i]
        res = self.res
        messages: tuple[Message, ...] | None = None
        if r.is_chat:
            if r.parent >= 0:
                messages = (*self.history[r.parent], *r.messages)
                if len(self.children.get(r.parent, ())) <= 1:
                    del self.history[r.parent]
            else:
                messages = r.messages
            ids = self.builder.chat_ids(messages)
            if i in self.children:
                self.history[i] = messages
        else:
            ids = self.builder.completion_ids(r.prompt or ())
        res.sent[i] = now
        res.prompt_tokens[i] = len(ids)
        hits_before = self.oracle.hits
        hashes = self.oracle.on_send(ids)
        res.oracle_cached[i] = self.oracle.hits - hits_before
        request = InferenceRequest(
            request_id=str(i), model=self.cfg.profile.model, api=ApiKind.CHAT if r.is_chat else ApiKind.COMPLETIONS,
            path="/v1/chat/completions" if r.is_chat else "/v1/completions",
            prompt_text=prompt_text(messages, r.prompt), stream=True, max_tokens=r.max_tokens, session_id=r.session)
        try:
            if self.admission is not None:
                self.admission.check(request, self.endpoints, now)
            chosen = self.scheduler.schedule(request, self.endpoints, now).ranked[0]
            self.scheduler.on_picked(request, chosen, now)
        except RequestError as err:
            if err.status == 429:
                res.status[i] = SHED
            self.done()
            return
        k = self.pod_of[chosen.address]
        try:
            self.engines[k].add_request(SimRequest(str(i), ids, r.max_tokens, ignore_eos=True), now)
        except ValueError as exc:
            if len(res.notes) < 5:
                res.notes.append(f"request {i} refused by pod {k}: {exc}")
            self.done()
            return
        tokens = estimated_tokens(request)
        chosen.start_request(tokens, now)
        res.pod[i] = k
        self.served[k] += 1
        self.live[i] = (ids, hashes, tokens)
        self.wake(k, now)

    def deliver(self, k: int, result: StepResult, now: float) -> None:
        """Outputs of one batch at its end: first tokens, finished requests and their follow-ups."""
        res = self.res
        for rid in result.first_tokens:
            i = int(rid)
            self.first_token[i] = now
            res.ttft[i] = now - res.sent[i]
        for fin in result.finished:
            i = int(fin.request_id)
            ids, hashes, tokens = self.live.pop(i)
            self.endpoints[k].finish_request(tokens)
            res.e2e[i] = now - res.sent[i]
            out = len(fin.output_token_ids)
            res.output_tokens[i] = out
            res.cached_tokens[i] = fin.num_cached_tokens
            ft = self.first_token.pop(i, None)
            if ft is not None and out > 1:
                res.itl[i] = (now - ft) / (out - 1)
            res.status[i] = OK
            self.oracle.on_finish(hashes, ids + fin.output_token_ids)
            kids = self.children.get(i)
            if kids:
                if i in self.history:
                    self.history[i] = (*self.history[i], ("assistant", self.engines[k].decode(fin.output_token_ids)))
                for c in kids:
                    self.push(now + self.trace.requests[c].at, _ARRIVE, c)
            self.done()
        self.wake(k, now)

    def scrape(self, count: int, now: float) -> None:
        """What the picker's metrics scraper would have read at `now`."""
        for ep, eng in zip(self.endpoints, self.engines, strict=True):
            m = ep.metrics
            m.waiting = eng.num_waiting
            m.running = eng.num_running
            m.kv_usage = eng.kv_usage()
            m.updated_at = now
        cfg = self.cfg
        if count % max(1, round(cfg.sample_interval / cfg.scrape_interval)) == 0:
            self.res.load_times.append(now)
            self.res.load_per_pod.append([e.num_running + e.num_waiting for e in self.engines])
        if self.outstanding > 0:
            self.push(now + cfg.scrape_interval, _SCRAPE, count + 1)

    def finish_result(self, wall: float) -> RunResult:
        res = self.res
        res.pod_served = self.served
        res.pod_busy_s = self.busy
        for eng in self.engines:
            s = eng.stats
            res.prefix_queries += s.prefix_cache_queries
            res.prefix_hits += s.prefix_cache_hits
            res.prompt_tokens_total += s.prompt_tokens
            res.prompt_tokens_cached += s.prompt_tokens_cached
            res.generation_tokens += s.generation_tokens
            res.preemptions += s.num_preemptions
        res.oracle_queries = self.oracle.queries
        res.oracle_hits = self.oracle.hits
        first = min((t for t in res.sent if not math.isnan(t)), default=0.0)
        res.duration_s = self.last_event - first
        res.wall_s = wall
        return res
