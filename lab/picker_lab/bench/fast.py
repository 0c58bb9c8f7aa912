"""Fast mode: a discrete-event simulation of a whole fleet routed by one scheduler, in simulated time.

No network, no asyncio: simulated vLLM engines (`picker_lab.sim.engine.Engine`) are stepped from one event heap, and
the scheduler under test is the same object `picker serve` runs. It sees endpoints the way the live picker does:
metrics refreshed by scrapes on the scraper's cadence (`cadence`: fixed every `scrape_interval`, or adaptive per
pod as `picker serve` does by default) and its own in-flight counts, moved at pick and at the end of the response.

A scrape is not free for a real vLLM: it holds the pod's API server for `scrape_cost` seconds (bench/scrape_cost.py
measures ~5-7 ms of CPU per scrape on vLLM 0.32), and that loop is the one that takes in requests and streams
tokens. So each scrape delays the pod's next request intake and first token by that much (0: a free scrape).

Events, in time order (ties: deliveries, placements, arrivals, intakes, steps, scrapes, samples, restarts,
expiries, pool changes):
- arrival: build the request (a follow-up gets its parent's answer), the director's `begin` (placed now, held or
  refused), then its `place` (schedule), hand it to the pod;
- intake: the pod's API server passes a request on to its engine (at once unless scrapes hold it);
- step: the pod runs one batch; its outputs are delivered when the batch ends;
- deliver: first tokens, finished requests (in-flight released, follow-ups scheduled);
- scrape: refresh one pod's metrics in every replica's view and schedule its next scrape;
- sample: every `sample_interval`, record per-pod load;
- place: a held request its gate let go is scheduled (`Director.place`); expire: a hold's deadline has come
  (flow control: 503; the bounded wait: it goes anyway);
- with `leave_rejoin`: the last pod leaves every replica's pool (what it holds runs on: a drain) and later comes
  back with an empty cache, as a restarted pod does (bench-real's leave-rejoin workload).

Several picker replicas (`replicas` > 1) stand for N `picker serve` processes behind one Envoy, which round-robins
ext_proc streams over them: the n-th arriving request goes to replica n % N. Each replica has its own scheduler
(seed + r), admission gate and Endpoint objects (its own in-flight counts); the scrape refreshes every
replica's copy of a pod's metrics with the same values. Each replica keeps its own prefix index, or with
`shared_index` all share one `InMemoryPrefixIndex`: the Redis/Valkey-shared index (`--index-backend redis`) with
zero replication lag. With `load_sync_interval` they also share their in-flight counts as `--shared-load-interval`
does: every interval each replica's peer counts become the others' counts then, and a peer's pick counts at once in
between (flow control admits on the fleet's count; routing scores its own).

`admission_config` is the picker's `admission:` section as `picker serve` reads it: its objectives give requests their
priority (a trace request names its objective and tenant), and with `flowControl` each replica runs the flow
controller `picker serve` runs, on simulated time: requests wait in it, are let through as finishes and scrapes free
room, and are refused as they would be.
"""

from __future__ import annotations

import copy
import heapq
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from picker.core.requests import ApiKind, InferenceRequest, RequestError
from picker.endpoints.pool import EndpointPool
from picker.endpoints.scraper import Cadence
from picker.endpoints.state import Endpoint
from picker.prefix.hashing import PrefixHasher
from picker.prefix.index import PrefixIndex
from picker.prefix.precise import PreciseIndex, PrecisePrefix
from picker.routing import plugins as request_plugins
from picker.routing.admission import AdmissionConfig, Hold, Priorities, Ungated
from picker.routing.decision import Decision
from picker.routing.director import Director
from picker.routing.lifecycle import PluginDeps
from picker.scheduling.config import (
    build_hasher,
    scheduling_config,
)
from picker.scheduling.disagg import ROLE_LABEL
from picker.scheduling.plugins import PeerPick
from picker.scheduling.types import Scheduler
from picker.serving.policy import build_gate
from picker_lab.bench.fast_config import (
    DirectorInput,
    ExactCacheIndex,
    FastConfig,
    make_scheduler,
    shared_prefix_index,
)
from picker_lab.bench.fast_fleet import (
    _ARRIVE,
    _DELIVER,
    _EXPIRE,
    _INTAKE,
    _LOAD_SYNC,
    _PLACE,
    _POOL,
    _RESTART,
    _SAMPLE,
    _SCRAPE,
    _STEP,
    FleetEvents,
)
from picker_lab.bench.oracle import InfiniteCacheOracle
from picker_lab.bench.prompts import PromptBuilder, prompt_text
from picker_lab.bench.results import OK, SHED, RunResult
from picker_lab.bench.trace import Message, Trace
from picker_lab.sim.engine import Engine, SimRequest, StepResult

Progress = Callable[[int], None]


def run_fast(trace: Trace, strategy: str, cfg: FastConfig, *, scheduling: Mapping[str, Any] | None = None,
             progress: Progress | None = None) -> RunResult:
    """Replay `trace` on a fresh simulated fleet routed by `strategy`; returns every measurement."""
    return _FastRun(trace, strategy, cfg, scheduling, progress).run()


class _FastRun(FleetEvents):
    """State of one replay; `run()` drains the event heap (the fleet's own events: FleetEvents)."""

    def __init__(self, trace: Trace, strategy: str, cfg: FastConfig, scheduling: Mapping[str, Any] | None,
                 progress: Progress | None) -> None:
        self.trace = trace
        self.cfg = cfg
        self.progress = progress
        profile = cfg.profile
        self.res = RunResult("fast", trace.workload, strategy, cfg.pods, len(trace))
        self.res.allocate()
        self.engines = [Engine(profile, seed=cfg.seed, enable_prefix_caching=cfg.prefix_caching,
                               record_kv_events=cfg.precise) for _ in range(cfg.pods)]
        if cfg.replicas < 1:
            raise ValueError("replicas must be >= 1")
        # Per replica: its own Endpoint objects (same addresses), scheduler and admission controller.
        self.replica_endpoints = [self.make_endpoints() for _ in range(cfg.replicas)]
        self.endpoints = self.replica_endpoints[0]
        self.pod_of = {ep.address: k for k, ep in enumerate(self.endpoints)}
        index: PrefixIndex | None = shared_prefix_index(strategy, scheduling) if cfg.shared_index else None
        self.exact = ExactCacheIndex(self.engines, [e.address for e in self.endpoints]) if cfg.exact_index else None
        if self.exact is not None:
            index = self.exact
        # Every replica follows every pod's events (each its own subscriber), so they hold the same precise view:
        # applied at the end of the engine step that raised them (no transport lag).
        self.precise = PreciseIndex() if cfg.precise else None
        prefix = PrecisePrefix(self.precise) if self.precise is not None else None
        schedulers = [make_scheduler(strategy, cfg.seed + r, scheduling, index=index, precise=prefix)
                      for r in range(cfg.replicas)]
        self.bypass_rng = random.Random(f"bypass:{cfg.seed}")
        use_admission = cfg.admission and strategy != "round-robin"
        own_config = scheduling_config(scheduling if strategy == "picker" else None)
        admission = cfg.admission_config if cfg.admission_config is not None else AdmissionConfig()
        self.now = 0.0  # the simulated clock the admission gates read
        self.admission = admission
        self.gated = use_admission
        self.chars_per_token = schedulers[0].chars_per_token  # how the replicas count a prompt's tokens
        # The director `picker serve` runs, one per replica, called synchronously in simulated time.
        self.directors = [self.make_director(endpoints, scheduler, self.simulated_time)
                          for endpoints, scheduler in zip(self.replica_endpoints, schedulers, strict=True)]
        # What the first replica's director was given, in order, and what it decided (cfg.record_inputs): a replay
        # through `picker serve`'s own path must decide the same (tests/test_director_both_ways.py).
        self.inputs: list[DirectorInput] | None = [] if cfg.record_inputs else None
        self.hasher: PrefixHasher = build_hasher(own_config)
        self.arrivals = 0  # requests dealt to replicas so far
        use_peers = cfg.replicas > 1 and cfg.shared_index and cfg.peer_picks
        self.peers: list[Callable[[PeerPick, float], None]] = (
            [s.on_peer_picked for s in schedulers] if use_peers else [])
        self.builder = PromptBuilder(self.engines[0].tokenizer)
        self.oracle = InfiniteCacheOracle(profile.block_size)
        self.children = trace.children()
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.scheduled = [False] * cfg.pods
        self.busy = [0.0] * cfg.pods
        self.api_busy_until = [0.0] * cfg.pods  # the pod's API server is rendering /metrics until then
        self.cadence = cfg.cadence or Cadence.fixed(cfg.scrape_interval)
        # Replicas sharing an index share scrapes too (one scrape per pod per cadence); otherwise each scrapes.
        self.scrapers = 1 if cfg.shared_index else cfg.replicas
        self.scrapes = [0] * cfg.pods
        self.served = [0] * cfg.pods
        # vllm:request_prefill_kv_computed_tokens_sum and _prefill_time_seconds_sum per pod (at request finish)
        self.prefill_tokens = [0.0] * cfg.pods
        self.prefill_seconds = [0.0] * cfg.pods
        self.prefill_count = [0] * cfg.pods
        self.ttft_seconds = [0.0] * cfg.pods  # vllm:time_to_first_token_seconds sum and count, engine time
        self.ttft_count = [0] * cfg.pods
        self.history: dict[int, tuple[Message, ...]] = {}  # full messages (+ answer) of requests with follow-ups
        # index -> (prompt ids, oracle hashes, its decision (None: no picker routed it), replica that routed it)
        self.live: dict[int, tuple[list[int], list[int], Decision | None, int]] = {}
        self.prefilling: dict[int, int] = {}  # P/D: index -> its decode pod, while its prefill leg runs
        self.first_token: dict[int, float] = {}
        self.outstanding = len(trace)
        self.pod_index = {e.address: k for k, e in enumerate(self.endpoints)}  # address -> pod number
        self.unreported = 0
        self.last_event = 0.0

    def tell_peers(self, replica: int, decision: Decision, address: str, now: float) -> None:
        """What the shared index's stream tells the other replicas of a pick (picker/prefix/shared.py)."""
        request = decision.request
        chars = len(request.prompt_text)
        context = decision.result.context if decision.result is not None else None
        # as picker.serving.policy.peer_listener hears it
        pick = PeerPick(address, chars / self.chars_per_token, request.session_id or "", chars,
                        context.keys if context is not None else ())
        tokens = pick.prompt_tokens
        for r, hook in enumerate(self.peers):
            if r != replica:
                hook(pick, now)
                if self.cfg.load_sync_interval > 0:  # counted until the next sync, as SharedLoad.peer_picked does
                    self.replica_endpoints[r][self.pod_index[address]].peer_started(tokens)

    def simulated_time(self) -> float:
        return self.now

    def make_director(self, endpoints: list[Endpoint], scheduler: Scheduler,
                      clock: Callable[[], float]) -> Director:
        """A replica's director as `picker serve` builds it: its pool, its admission gate, the same priorities and
        request plugins (no metrics or traces: nothing observes them here)."""
        pool = _pool_of(endpoints)
        admission = self.admission
        gate = build_gate(admission, self.chars_per_token, pool, clock=clock) if self.gated else Ungated()
        return Director(pool, scheduler, gate=gate, plugins=request_plugins.build(PluginDeps(scheduler, clock)),
                        priorities=Priorities(admission), clock=clock)

    def note(self, replica: int, entry: DirectorInput) -> None:
        if self.inputs is not None and replica == 0:
            self.inputs.append(entry)

    def make_endpoints(self) -> list[Endpoint]:
        """One replica's view of the pods."""
        endpoints = [Endpoint.from_address(f"10.0.{k // 250}.{k % 250 + 1}:8000", name=f"pod-{k}")
                     for k in range(self.cfg.pods)]
        for k, role in enumerate(self.cfg.roles):
            endpoints[k].labels = {ROLE_LABEL: role}
        for ep in endpoints:
            ep.metrics.block_size = self.cfg.profile.block_size
            ep.metrics.num_gpu_blocks = max(2, round(self.cfg.profile.num_gpu_blocks * self.cfg.kv_reported))
        return endpoints

    def push(self, t: float, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, payload))

    def run(self) -> RunResult:
        wall0 = time.perf_counter()
        for r in self.trace.requests:
            if r.parent < 0:
                self.push(r.at, _ARRIVE, r.index)
        for k in range(self.cfg.pods if self.cfg.scraping else 0):
            self.push(0.0, _SCRAPE, k)
        self.push(0.0, _SAMPLE, 0)
        if self.cfg.restart_every > 0:
            self.push(self.cfg.restart_every, _RESTART, 0)
        if self.cfg.leave_rejoin is not None:
            leave, rejoin = self.cfg.leave_rejoin
            self.push(leave, _POOL, False)
            self.push(rejoin, _POOL, True)
        if self.cfg.load_sync_interval > 0 and self.cfg.replicas > 1:
            self.push(self.cfg.load_sync_interval, _LOAD_SYNC, 0)
        heap = self.heap
        pop = heapq.heappop
        while heap:
            now, kind, _, payload = pop(heap)
            self.now = now
            if kind == _STEP:
                self.step(payload, now)
            elif kind == _DELIVER:
                self.deliver(payload[0], payload[1], now)
            elif kind == _ARRIVE:
                self.arrive(payload, now)
            elif kind == _INTAKE:
                self.intake(payload[0], payload[1], now)
            elif kind == _SCRAPE:
                self.scrape(payload, now)
                continue
            elif kind == _RESTART:
                self.restart(payload, now)
                continue
            elif kind == _POOL:
                self.pool_change(payload, now)
                continue
            elif kind == _PLACE:
                i, request, ids, hashes, replica = payload
                self.place(i, request, ids, hashes, replica, now)
            elif kind == _EXPIRE:
                self.expire(payload[0], payload[1], payload[2], now)
            elif kind == _LOAD_SYNC:
                self.sync_load(now)
                continue
            else:
                self.sample(now)
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
            prompt_text=prompt_text(messages, r.prompt), stream=True, max_tokens=r.max_tokens, session_id=r.session,
            objective=r.objective, fairness_id=r.tenant)
        if self.exact is not None:
            self.exact.prepare(ids, len(request.prompt_text), self.hasher.block_chars(self.cfg.profile.block_size))
        if self.precise is not None:
            request.token_ids = ids  # what `--tokenizer` or the pod's /tokenize would give
        if self.cfg.bypass and self.bypass_rng.random() < self.cfg.bypass:
            self.around_the_picker(i, ids, hashes, r.max_tokens, now)
            return
        replica = self.arrivals % self.cfg.replicas  # Envoy round-robins ext_proc streams over the replicas
        self.arrivals += 1
        self.offer(i, request, ids, hashes, replica, now)

    def offer(self, i: int, request: InferenceRequest, ids: list[int], hashes: list[int], replica: int,
              now: float) -> None:
        """The director's first step, as `picker serve` runs it: placed now, refused, or held; a held request is
        placed when its gate lets it go (an event now) and hears its deadline as an event."""
        director = self.directors[replica]

        def go() -> bool:
            self.push(self.now, _PLACE, (i, request, ids, hashes, replica))
            return True
        if self.inputs is not None:
            self.note(replica, DirectorInput("arrive", now, i, request=copy.copy(request)))
        try:
            hold, candidates = director.begin(request, go)
        except RequestError as err:
            self.note(replica, DirectorInput("refused", now, i, outcome=str(err.status)))
            self.refused(i, err, now)
            return
        if hold is None:
            self.place(i, request, ids, hashes, replica, now, candidates)
        elif hold.queued:
            self.push(hold.deadline, _EXPIRE, (i, hold, replica))

    def place(self, i: int, request: InferenceRequest, ids: list[int], hashes: list[int], replica: int,
              now: float, candidates: Sequence[Endpoint] | None = None) -> None:
        """The director's second step: the request is scheduled now and sent to its pod."""
        try:
            decision = self.directors[replica].place(request, now, candidates=candidates)
        except RequestError as err:
            self.note(replica, DirectorInput("placed", now, i, outcome=str(err.status)))
            self.refused(i, err, now)
            return
        self.note(replica, DirectorInput("placed", now, i, outcome=decision.destination))
        self.send(i, decision, ids, hashes, replica, now)

    def expire(self, i: int, hold: Hold, replica: int, now: float) -> None:
        refusal = self.directors[replica].expire(hold)
        if refusal is not None:
            self.note(replica, DirectorInput("expired", now, i, outcome=str(refusal.status)))
            self.refused(i, refusal, now)

    def refused(self, i: int, err: RequestError, now: float) -> None:
        """The picker answered the request itself: 429 counts as shed, anything else as failed; its e2e is the
        time to that answer."""
        if err.status == 429:
            self.res.status[i] = SHED
        self.res.e2e[i] = now - self.res.sent[i]
        self.done()

    def send(self, i: int, decision: Decision, ids: list[int], hashes: list[int], replica: int, now: float) -> None:
        """Hand a routed request to its pod (through the pod's API server, which scrapes may hold)."""
        chosen = decision.endpoint
        r = self.trace.requests[i]
        res = self.res
        if self.peers:
            self.tell_peers(replica, decision, chosen.address, now)
        k = self.pod_of[chosen.address]
        prefill_pod = self.prefill_leg(i, decision, ids, now) if decision.prefill is not None else None
        sim_request = SimRequest(str(i), ids, r.max_tokens, ignore_eos=True)
        # the router's path, and scrapes holding the pod's API server, hand the request to the engine later
        reach = max(self.api_busy_until[k], now + self.cfg.path_delay)
        delayed = reach > now
        if prefill_pod is None and not delayed and not self.hand_over(k, sim_request, now):
            self.ended(i, replica, decision, now)
            return
        res.pod[i] = k
        self.served[k] += 1
        self.live[i] = (ids, hashes, decision, replica)
        if prefill_pod is not None:  # the decode leg follows when the prefill leg ends (`decoded`)
            self.prefilling[i] = k
            self.wake(prefill_pod, now)
        elif delayed:
            self.push(reach, _INTAKE, (k, sim_request))
        else:
            self.wake(k, now)

    def prefill_leg(self, i: int, decision: Decision, ids: list[int], now: float) -> int | None:
        """P/D, as `picker pd-sidecar` does it: the prompt with one output token to the prefill pod first; its
        index, or None when that pod refused it (the request is then prefilled where it decodes)."""
        assert decision.prefill is not None
        kp = self.pod_of[decision.prefill.address]
        if not self.hand_over(kp, SimRequest(f"p{i}", ids, 1, ignore_eos=True), now, counts=False):
            return None
        return kp

    def decoded(self, i: int, now: float) -> None:
        """The prefill leg ended: the response begins (the director hears it), and the decode leg goes to the
        decode pod, which loads the prompt's blocks instead of computing them."""
        k = self.prefilling.pop(i)
        ids, _, decision, replica = self.live[i]
        if decision is not None:
            self.directors[replica].response_started(decision)
        request = SimRequest(str(i), ids, self.trace.requests[i].max_tokens, ignore_eos=True, remote_prefill=True)
        if self.hand_over(k, request, now):
            self.wake(k, now)
            return
        self.live.pop(i)
        self.ended(i, replica, decision, now)

    def around_the_picker(self, i: int, ids: list[int], hashes: list[int], max_tokens: int, now: float) -> None:
        """A request sent straight to a random pod (another gateway, a batch job): no picker sees it."""
        k = self.bypass_rng.randrange(self.cfg.pods)
        if not self.hand_over(k, SimRequest(str(i), ids, max_tokens, ignore_eos=True), now):
            return
        self.res.pod[i] = k
        self.res.bypassed.append(i)
        self.served[k] += 1
        self.live[i] = (ids, hashes, None, -1)  # no picker counts it in flight
        self.wake(k, now)

    def hand_over(self, k: int, request: SimRequest, now: float, counts: bool = True) -> bool:
        """Give the request to pod k's engine; a refused one (vLLM's 400) ends at once (`counts`: it is the
        request's last leg, so it is done)."""
        try:
            self.engines[k].add_request(request, now)
        except ValueError as exc:
            if len(self.res.notes) < 5:
                self.res.notes.append(f"request {request.request_id} refused by pod {k}: {exc}")
            if counts:
                self.done()
            return False
        return True

    def intake(self, k: int, request: SimRequest, now: float) -> None:
        """A request held by the pod's busy API server reaches its engine."""
        if self.hand_over(k, request, now):
            self.wake(k, now)
            return
        i = int(request.request_id)
        _, _, decision, replica = self.live.pop(i)
        self.ended(i, replica, decision, now)
        self.served[k] -= 1
        self.res.pod[i] = -1

    def ended(self, i: int, replica: int, decision: Decision | None, now: float) -> None:
        """A request has ended: the director that routed it releases it (in-flight count down, room freed), as
        `picker serve`'s does when the stream closes. None: no picker routed it."""
        if decision is None:
            return
        self.note(replica, DirectorInput("ended", now, i))
        self.directors[replica].release(decision)

    def deliver(self, k: int, result: StepResult, now: float) -> None:
        """Outputs of one batch at its end: first tokens, finished requests and their follow-ups."""
        res = self.res
        if self.precise is not None and result.kv_events:
            self.precise.apply(self.endpoints[k].address, result.kv_events, now)
        streamed = max(now, self.api_busy_until[k])  # the first token leaves through the pod's API server
        for rid in result.first_tokens:
            if rid[0] == "p":  # a prefill leg's token goes back to the sidecar, not to the client
                continue
            i = int(rid)
            self.first_token[i] = streamed
            res.ttft[i] = streamed - res.sent[i]
        for fin in result.finished:
            if fin.request_id[0] == "p":
                self.decoded(int(fin.request_id[1:]), now)
                continue
            i = int(fin.request_id)
            ids, hashes, decision, replica = self.live.pop(i)
            if fin.first_scheduled_time is not None and fin.first_token_time is not None:
                self.prefill_tokens[k] += fin.prompt_tokens - fin.num_cached_tokens
                self.prefill_seconds[k] += fin.first_token_time - fin.first_scheduled_time
                self.prefill_count[k] += 1
            if fin.ttft is not None:
                self.ttft_seconds[k] += fin.ttft
                self.ttft_count[k] += 1
            self.ended(i, replica, decision, now)
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


def _pool_of(endpoints: list[Endpoint]) -> EndpointPool:
    pool = EndpointPool()
    pool.set_endpoints(endpoints)
    return pool
