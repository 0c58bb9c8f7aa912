"""One simulated vLLM instance in simulated time: a pure, steppable model of vLLM V1's scheduler and KV cache.

No I/O and no clock of its own: the caller passes `now` (seconds of model time) to every call, so the same engine
runs under the real-time HTTP driver (`picker_lab.sim.driver`) and inside a discrete-event benchmark loop.

Stepping API::

    engine = Engine(profile, seed=0, lora_modules={"name": "path"}, record_kv_events=False)
    engine.add_request(SimRequest(request_id, prompt_token_ids, max_tokens, lora_name=None, cache_salt=None,
                                  ignore_eos=False, min_tokens=0), now)
    t = engine.next_step_time()        # None when idle, else the earliest model time the next step may start
                                       # (the end of the previous step: one forward pass at a time; a request
                                       # is not admitted before the `now` it was added with)
    result = engine.step(max(t, now))  # schedule one batch at `now` and run it
    result.start, result.duration, result.end          # the batch's outputs all happen at `result.end`
    result.first_tokens      # request ids whose first output token came out of this step
    result.ttfts             # their time to first token (model seconds), same order
    result.new_tokens        # [(request_id, token_id)] emitted at result.end, in batch order
    result.finished          # [FinishedRequest] (finish_reason "length" | "stop"), blocks already freed
    result.preempted         # request ids preempted (recompute) while scheduling this step
    result.kv_events         # BlockStored/BlockRemoved/AllBlocksCleared (only with record_kv_events=True)
    engine.abort_request(request_id, now)   # -> FinishedRequest with finish_reason "abort", or None

A discrete-event loop over many engines: keep a heap of (engine.next_step_time(), engine) and of request
arrivals; before stepping an engine at time t, add every arrival with time <= t; after `add_request` on an idle
engine, its next step starts at the arrival time.

Scheduler (vLLM V1, FCFS): each step first gives every running request its next tokens (1 for a decode, the rest of
a chunked prefill up to the token budget); if KV blocks run out, the most recently admitted running request is
preempted (blocks freed, requeued at the front of the waiting queue, later recomputed). If nothing was preempted,
waiting requests are admitted in FIFO order while the token budget (`max_num_batched_tokens`), `max_num_seqs` and
free blocks allow (the whole sequence must fit, as with vLLM 0.32's scheduler_reserve_full_isl); a request that
does not fit blocks the queue (head-of-line). A waiting request whose LoRA
adapter would exceed `max_loras` adapters in the batch is skipped for this step. On admission the longest cached
prefix of full blocks is reused, never including the last prompt token. Full blocks enter the prefix cache when the
step computing them is scheduled, so identical prompts admitted in the same step share the work.

Failure isolation: `step` never raises because of one request. A request whose scheduling or update raises
is finished with finish_reason "error" (vLLM's FinishReason.ERROR; the HTTP layer answers 500), the exception
is logged once, and the other requests carry on: the caller's stepping loop must survive, since when it died
the pod kept answering /health while every request to it hung.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import OrderedDict, deque

import xxhash

from picker_lab.sim.batch import RequestState, step_duration
from picker_lab.sim.engine_types import EngineStats, FinishedRequest, SimRequest, StepResult
from picker_lab.sim.kvcache import KVCache, extend_block_hashes
from picker_lab.sim.profiles import Profile
from picker_lab.sim.tokenizer import PseudoWords, Tokenizer, is_utf8

log = logging.getLogger(__name__)

ERROR = "error"  # finish_reason of a request that failed inside the engine (vLLM's FinishReason.ERROR)


class Engine:
    """A simulated vLLM engine core: scheduler + KV cache + step-time model."""

    def __init__(
        self,
        profile: Profile,
        *,
        seed: int = 0,
        lora_modules: dict[str, str] | None = None,
        record_kv_events: bool = False,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.profile = profile
        self.seed = seed
        self.block_size = profile.block_size
        self.kv = KVCache(profile.num_gpu_blocks, profile.block_size, enable_prefix_caching,
                          host_blocks=profile.num_cpu_blocks if enable_prefix_caching else 0)
        self.kv.record_events = record_kv_events
        self.tokenizer = Tokenizer(profile.vocab_size)
        self.words = PseudoWords(self.tokenizer)
        # vLLM numbers adapters from 1 in --lora-modules order (lora_int_id).
        self.lora_modules: dict[str, str] = dict(lora_modules or {})
        self.lora_ids: dict[str, int] = {name: i + 1 for i, name in enumerate(self.lora_modules)}
        self.loaded_loras: OrderedDict[str, None] = OrderedDict()
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.requests: dict[str, RequestState] = {}
        self.stats = EngineStats()
        self.busy_until = -math.inf
        self._culprit: RequestState | None = None  # the request being scheduled: failed alone if scheduling raises

    # --- inputs ----------------------------------------------------------------------------------------------
    def add_request(self, req: SimRequest, now: float) -> None:
        """Queue a request that arrived at model time `now`."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if not req.prompt_token_ids:
            raise ValueError("empty prompt")
        if len(req.prompt_token_ids) >= self.profile.max_model_len:
            raise ValueError("prompt does not fit max_model_len")
        longest = min(len(req.prompt_token_ids) + req.max_tokens, self.profile.max_model_len)
        if -(-longest // self.block_size) > self.kv.num_blocks - 1:
            # vLLM refuses to start unless one max_model_len request fits; with a smaller override we refuse the
            # request instead of preempting it forever
            raise ValueError("request needs more KV-cache blocks than the engine has")
        if req.lora_name is not None and req.lora_name not in self.lora_ids:
            raise ValueError(f"unknown LoRA adapter {req.lora_name!r}")
        if req.cache_salt is not None and not is_utf8(req.cache_salt):
            raise ValueError("cache_salt must be valid UTF-8 text (it contains a lone surrogate)")
        state = RequestState(req, now, self._stream_key(req), self._stop_at(req), self.lora_ids.get(req.lora_name or ""))
        self.requests[req.request_id] = state
        self.waiting.append(state)

    def abort_request(self, request_id: str, now: float) -> FinishedRequest | None:
        """Remove a request (client went away); frees its blocks."""
        st = self.requests.get(request_id)
        if st is None:
            return None
        if st in self.running:
            self.running.remove(st)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(st)
        return self._finish(st, "abort", now)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefixes (only when no request holds blocks, as in vLLM)."""
        return self.kv.reset()

    # --- queries ---------------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        """vllm:num_requests_running."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """vllm:num_requests_waiting."""
        return len(self.waiting)

    def kv_usage(self) -> float:
        """vllm:kv_cache_usage_perc."""
        return self.kv.usage()

    def has_work(self) -> bool:
        """Whether a step would do anything."""
        return bool(self.running or self.waiting)

    def next_step_time(self) -> float | None:
        """Earliest model time of the next step, or None when idle (the caller picks max(this, now))."""
        if self.running:
            return self.busy_until
        if self.waiting:
            return max(self.busy_until, self.waiting[0].arrival)
        return None

    def probe_prefix_hit_tokens(
        self, token_ids: list[int], lora_name: str | None = None, cache_salt: str | None = None
    ) -> int:
        """Tokens a request with this prompt would get from the prefix cache right now (no side effects)."""
        hashes: list[int] = []
        extend_block_hashes(hashes, token_ids, self.block_size, lora_name, cache_salt)
        max_blocks = (len(token_ids) - 1) // self.block_size
        return len(self.kv.lookup(hashes, max_blocks)) * self.block_size

    def running_loras(self) -> list[str]:
        """LoRA names of running requests in batch order (vllm:lora_requests_info running_lora_adapters)."""
        return list(dict.fromkeys(st.req.lora_name for st in self.running if st.req.lora_name))

    def waiting_loras(self) -> list[str]:
        """LoRA names of waiting requests in queue order (vllm:lora_requests_info waiting_lora_adapters)."""
        return list(dict.fromkeys(st.req.lora_name for st in self.waiting if st.req.lora_name))

    def inflight_loras(self) -> list[str]:
        """LoRA names with at least one unfinished request, in arrival order."""
        return list(dict.fromkeys(st.req.lora_name for st in self.requests.values() if st.req.lora_name))

    def decode(self, token_ids: list[int]) -> str:
        """Text of generated token ids."""
        return self.words.decode(token_ids)

    # --- the step --------------------------------------------------------------------------------------------
    def step(self, now: float) -> StepResult:
        """Schedule one batch at model time `now` (>= next_step_time()), run it, return what came out.

        A request whose scheduling raises is finished with "error" (in `result.finished`) and the batch is
        scheduled again without it: scheduling only moves requests between queues and gives them blocks, so a
        retry is sound.
        """
        if now < self.busy_until:
            raise ValueError(f"step at {now} before the previous step ends at {self.busy_until}")
        failed: list[FinishedRequest] = []
        while True:
            self._culprit = None
            try:
                result = self._schedule_and_run(now)
            except Exception as exc:
                if not self._fail_culprit(exc, now, failed):
                    raise  # no request to blame and none in flight: a bug that retrying cannot get past
                continue
            if failed:
                result.finished[:0] = failed
            return result

    def _fail_culprit(self, exc: Exception, now: float, failed: list[FinishedRequest]) -> bool:
        """Fail the request whose scheduling raised (every request in flight if it was in no request's code),
        and any request the exception left outside both queues; log once. False if nothing changed."""
        victims = [self._culprit] if self._culprit is not None else list(self.requests.values())
        queued = {id(st) for st in self.running} | {id(st) for st in self.waiting}
        victims += [st for st in self.requests.values() if id(st) not in queued and st not in victims]
        changed = [st.req.request_id for st in victims if self._fail(st, now, failed)]
        if changed:
            log.error("engine step failed; finishing request(s) %s with an error, the engine keeps serving",
                      ", ".join(changed), exc_info=exc)  # fmt: skip
        return bool(changed)

    def _fail(self, st: RequestState, now: float, into: list[FinishedRequest]) -> bool:
        """Take `st` out of the engine and finish it with "error" (appended to `into`, blocks freed if the
        cache allows); False if it was no longer in the engine."""
        rid = st.req.request_id
        queued = st in self.running
        if queued:
            self.running.remove(st)
        elif st in self.waiting:
            queued = True
            self.waiting.remove(st)
        if self.requests.get(rid) is not st:
            return queued
        del self.requests[rid]
        with contextlib.suppress(Exception):  # the block bookkeeping may be what failed: leak, don't re-raise
            self.kv.free(st.blocks)
        st.blocks = []
        self.stats.finished[ERROR] = self.stats.finished.get(ERROR, 0) + 1
        into.append(self._record(st, ERROR, now))
        return True

    def _schedule_and_run(self, now: float) -> StepResult:
        """One step: schedule running requests, admit waiting ones, run the batch."""
        budget = self.profile.max_num_batched_tokens
        scheduled: list[tuple[RequestState, int, int]] = []  # (state, new tokens, context before them)
        preempted: list[str] = []
        loaded: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            st = self.running[i]
            self._culprit = st
            n = min(len(st.tokens) - st.num_computed, budget)
            if n <= 0:
                i += 1
                continue
            while not self._allocate(st, n, ()):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.req.request_id)
                if victim is st:
                    break
            else:
                scheduled.append((st, n, st.num_computed))
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted: nothing after it is left in running

        if not preempted:
            budget = self._admit_waiting(now, budget, scheduled, loaded)
        self._culprit = None

        duration = step_duration(self.profile, scheduled, len(loaded))
        end = now + duration
        self.busy_until = end
        result = StepResult(start=now, duration=duration, end=end, preempted=preempted, loaded_loras=loaded)
        self._execute(scheduled, end, result)
        if self.kv.record_events:
            result.kv_events = self.kv.drain_events()
        self.stats.num_steps += 1
        return result

    def _admit_waiting(
        self, now: float, budget: int, scheduled: list[tuple[RequestState, int, int]], loaded: list[str]
    ) -> int:
        """FIFO admission of waiting requests into the running batch; returns the remaining token budget."""
        skipped: list[RequestState] = []
        active_loras = {st.req.lora_name for st in self.running if st.req.lora_name}
        max_seqs = self.profile.max_num_seqs
        bs = self.block_size
        while self.waiting and budget > 0 and len(self.running) < max_seqs:
            st = self.waiting[0]
            self._culprit = st
            if st.arrival > now:
                break  # not arrived yet in model time (the real-time driver may run slightly behind the clock)
            lora = st.req.lora_name
            if lora and lora not in active_loras and len(active_loras) >= self.profile.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            hits: list[int] = []
            if st.num_computed == 0:
                extend_block_hashes(st.hashes, st.tokens, bs, lora, st.req.cache_salt)
                hits = self.kv.lookup(st.hashes, (len(st.tokens) - 1) // bs)
            num_hit_tokens = len(hits) * bs
            remote = 0
            load_cost = 0.0
            if st.req.remote_prefill and st.num_computed == 0 and st.num_preemptions == 0:
                # the prompt's full blocks the pod lacks come from the prefill pod (the last token is computed)
                remote = max(0, (len(st.tokens) - 1) // bs * bs - num_hit_tokens)
                load_cost = self.profile.kv_transfer_cost
            elif st.num_computed == 0 and self.kv.host_blocks:
                # what follows the device's prefix and host memory holds is loaded, not computed
                remote = self.kv.lookup_host(st.hashes, len(hits), (len(st.tokens) - 1) // bs) * bs
                load_cost = self.profile.host_load_cost
            # vLLM 0.32 (scheduler_reserve_full_isl) admits a request only if its whole sequence fits, not just
            # the first chunk
            full_blocks = -(-min(len(st.tokens), self.profile.max_model_len) // bs)
            if not self.kv.can_allocate(full_blocks - len(hits), hits):
                break
            n = len(st.tokens) - num_hit_tokens
            if n - remote > budget:  # loaded tokens take no compute budget
                if not self.profile.enable_chunked_prefill:
                    break
                n = remote + budget
            if not self._allocate(st, n, hits, num_hit_tokens):
                break
            self.waiting.popleft()
            st.loading = remote
            st.load_cost = load_cost
            # counted at admission, and not for re-admitted preempted requests (vLLM's PrefixCacheStats)
            if st.num_preemptions == 0:
                self.stats.prefix_cache_queries += len(st.tokens)
                self.stats.prefix_cache_hits += num_hit_tokens
                if st.req.remote_prefill or self.kv.host_blocks:  # what vLLM asks of its KV connector
                    self.stats.external_queries += len(st.tokens) - num_hit_tokens
                    self.stats.external_hits += remote
            if st.num_cached_tokens < 0:
                st.num_cached_tokens = num_hit_tokens + remote
                st.num_external = remote
            if st.first_scheduled is None:
                st.first_scheduled = now
            if lora:
                active_loras.add(lora)
                if lora not in self.loaded_loras:
                    if len(self.loaded_loras) >= self.profile.max_loras:
                        for name in self.loaded_loras:
                            if name not in active_loras:
                                del self.loaded_loras[name]
                                break
                    self.loaded_loras[lora] = None
                    loaded.append(lora)
                else:
                    self.loaded_loras.move_to_end(lora)
            self.running.append(st)
            scheduled.append((st, n, st.num_computed))
            budget -= n - remote
        for st in reversed(skipped):
            self.waiting.appendleft(st)
        return budget

    def _allocate(self, st: RequestState, n: int, hits: list[int] | tuple[int, ...], num_hit_tokens: int = 0) -> bool:
        """Give `st` blocks for `n` more tokens (after `hits`); False when the free queue is too short."""
        kv = self.kv
        bs = self.block_size
        have = len(st.blocks) + len(hits)
        need = -(-(st.num_computed + num_hit_tokens + n) // bs) - have
        if need < 0:
            need = 0
        if not kv.can_allocate(need, hits):
            return False
        if hits:
            kv.touch(hits)
            st.blocks.extend(hits)
            st.num_computed = num_hit_tokens
            st.num_cached_blocks = len(hits)
        if need:
            st.blocks.extend(kv.allocate(need))
        # Like vLLM, blocks enter the prefix cache when the step that computes them is *scheduled*: a request
        # admitted later in the same step already hits them (its attention runs after their KV is written).
        full = (st.num_computed + n) // bs
        if full > st.num_cached_blocks:
            req = st.req
            extend_block_hashes(st.hashes, st.tokens, bs, req.lora_name, req.cache_salt)
            kv.cache_blocks(
                st.blocks, st.hashes, st.num_cached_blocks, full, st.tokens, st.lora_id, req.lora_name, req.cache_salt
            )
            prompt_blocks = min(full, st.num_prompt // bs)  # the connector offloads prompt blocks only (its default)
            if kv.host_blocks and prompt_blocks > st.num_cached_blocks:
                kv.offload(st.hashes[st.num_cached_blocks:prompt_blocks])
            st.num_cached_blocks = full
        return True

    def _preempt(self, st: RequestState) -> None:
        """Recompute-style preemption: free everything, keep the generated tokens, requeue at the front."""
        self.kv.free(st.blocks)
        st.blocks = []
        st.num_computed = 0
        st.num_cached_blocks = 0
        st.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(st)

    def _execute(self, scheduled: list[tuple[RequestState, int, int]], end: float, result: StepResult) -> None:
        """Apply the batch: advance computed tokens, sample tokens, finish requests. A request whose update
        raises is finished with "error" alone (logged once); the batch's other outputs still come out."""
        for st, n, ctx in scheduled:
            try:
                self._execute_one(st, n, ctx, end, result)
            except Exception:
                log.exception("request %s failed in an engine step; finishing it with an error, the engine "
                              "keeps serving", st.req.request_id)  # fmt: skip
                self._fail(st, end, result.finished)

    def _execute_one(self, st: RequestState, n: int, ctx: int, end: float, result: StepResult) -> None:
        """Apply one scheduled request's share of the batch: computed tokens, sampled token, finish."""
        st.loading = 0
        result.num_scheduled_tokens += n
        if n == 1 and ctx >= st.num_prompt:
            result.num_decode_seqs += 1
        else:
            result.num_prefill_tokens += n
        st.num_computed += n
        if st.num_computed < len(st.tokens):
            return  # chunked prefill not done yet
        token = self.words.token(st.stream_key, len(st.output))
        st.output.append(token)
        st.tokens.append(token)
        rid = st.req.request_id
        result.new_tokens.append((rid, token))
        stats = self.stats
        stats.generation_tokens += 1
        if st.first_token is None:
            st.first_token = end
            result.first_tokens.append(rid)
            result.ttfts.append(end - st.arrival)
            stats.prompt_tokens += st.num_prompt
            stats.prompt_tokens_cached += max(st.num_cached_tokens, 0)
            stats.prompt_tokens_external += st.num_external
        elif st.last_token is not None:
            result.inter_token_latencies.append(end - st.last_token)
        st.last_token = end
        reason = None
        n_out = len(st.output)
        if n_out >= st.req.max_tokens or len(st.tokens) >= self.profile.max_model_len:
            reason = "length"
        elif st.stop_at is not None and n_out >= st.stop_at:
            reason = "stop"
        if reason is not None:
            self.running.remove(st)
            result.finished.append(self._finish(st, reason, end))

    def _finish(self, st: RequestState, reason: str, now: float) -> FinishedRequest:
        """Free the request's blocks, forget it, count it."""
        self.kv.free(st.blocks)
        st.blocks = []
        del self.requests[st.req.request_id]
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        return self._record(st, reason, now)

    @staticmethod
    def _record(st: RequestState, reason: str, now: float) -> FinishedRequest:
        """The FinishedRequest of `st` (no side effects, so failing a request cannot fail again here)."""
        return FinishedRequest(
            request_id=st.req.request_id,
            finish_reason=reason,
            prompt_tokens=st.num_prompt,
            output_token_ids=st.output,
            num_cached_tokens=max(st.num_cached_tokens, 0),
            max_tokens=st.req.max_tokens,
            arrival_time=st.arrival,
            first_scheduled_time=st.first_scheduled,
            first_token_time=st.first_token,
            finish_time=now,
            num_preemptions=st.num_preemptions,
            lora_name=st.req.lora_name,
        )

    # --- determinism -----------------------------------------------------------------------------------------
    def _stream_key(self, req: SimRequest) -> int:
        """Seed of the request's output: same seed + prompt + adapter -> same text (like greedy decoding)."""
        from array import array

        data = array("I", req.prompt_token_ids).tobytes() + (req.lora_name or "").encode()
        return xxhash.xxh3_64_intdigest(data, seed=self.seed & 0xFFFFFFFFFFFFFFFF)

    def _stop_at(self, req: SimRequest) -> int | None:
        """Output length at which a pseudo-EOS appears (geometric, mean eos_mean_tokens), or None."""
        mean = self.profile.eos_mean_tokens
        if req.ignore_eos or not mean:
            return None
        u = (xxhash.xxh3_64_intdigest(b"eos", seed=self._stream_key(req)) + 1) / 2.0**64
        return max(req.min_tokens, 1 + int(-math.log(u) * mean))
