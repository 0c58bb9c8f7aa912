"""Named, seeded workload generators. Token counts are exact under the simulator's tokenizer.

Text is made of pseudo-words of two or three letters joined by spaces: each word is one token of
`picker_lab.sim.tokenizer.Tokenizer`, so "n words" is "n tokens" and a shared prefix is shared token for token.
Every generator draws its random numbers in a fixed order from `random.Random(f"{name}:{seed}")`, so the
same (name, seed, size, rate, fleet) always gives the same trace.
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from picker_lab.bench.trace import Message, Trace, TraceRequest
from picker_lab.sim.profiles import Profile

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"
# 1024 words, so a 10-bit random number picks one without bias
WORDS: tuple[str, ...] = tuple(
    [c + v for c in _CONSONANTS for v in _VOWELS]
    + [c + v + d for c in _CONSONANTS for v in _VOWELS for d in _CONSONANTS]
)[:1024]


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """What a workload may size itself by: the pod profile and the number of pods."""

    profile: Profile
    pods: int

    @property
    def kv_tokens(self) -> int:
        """Tokens the whole fleet's KV cache holds (usable blocks x block size x pods)."""
        return self.profile.usable_blocks() * self.profile.block_size * self.pods


def text(rng: random.Random, tokens: int) -> str:
    """`tokens` pseudo-words: exactly that many tokens under the simulator's tokenizer (16 random bits a word:
    ~10x cheaper than `rng.choices`, which matters for 100k-request traces)."""
    words = WORDS
    return " ".join([words[x & 1023] for x in array("H", rng.randbytes(2 * tokens))])


def arrivals(rng: random.Random, rate: float, n: int, kind: str = "poisson") -> list[float]:
    """Open-loop send times: Poisson at `rate`, or a ramp whose rate grows linearly from 10 % to 100 %."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    out: list[float] = []
    t = 0.0
    for i in range(n):
        r = rate if kind == "poisson" else rate * (0.1 + 0.9 * i / max(1, n - 1))
        t += rng.expovariate(r)
        out.append(t)
    if kind not in ("poisson", "ramp"):
        raise ValueError(f"unknown arrival kind {kind!r} (poisson, ramp)")
    return out


def _grouped(
    rng: random.Random, starts: list[float], sizes: list[int], gap_mean: float
) -> list[tuple[float, int, int]]:
    """(time, context, k) for bursts: context c starts at starts[c] and sends sizes[c] requests gap_mean apart
    (exponential gaps), sorted by time."""
    events: list[tuple[float, int, int]] = []
    for c, (t0, size) in enumerate(zip(starts, sizes, strict=True)):
        t = t0
        for k in range(size):
            if k:
                t += rng.expovariate(1.0 / gap_mean)
            events.append((t, c, k))
    events.sort()
    return events


WorkloadFn = Callable[..., Trace]


def chat(n: int, rate: float, seed: int, fleet: FleetSpec, *, arrival: str = "poisson", system_prompts: int = 4,
         system_len: int = 256, question_len: tuple[int, int] = (16, 64), output_len: int = 64) -> Trace:
    """Many users, a few shared system prompts of `system_len` tokens, a short unique question each."""
    rng = random.Random(f"chat:{seed}")
    systems = [text(rng, system_len) for _ in range(system_prompts)]
    times = arrivals(rng, rate, n, arrival)
    reqs = []
    for i, t in enumerate(times):
        g = rng.randrange(system_prompts)
        q = text(rng, rng.randint(*question_len))
        reqs.append(TraceRequest(i, t, output_len, g, (("system", systems[g]), ("user", q))))
    return Trace("chat", seed, rate, tuple(reqs), {"system_prompts": system_prompts, "system_len": system_len,
                                                   "question_len": list(question_len), "output_len": output_len})


def bursty(n: int, rate: float, seed: int, fleet: FleetSpec, *, arrival: str = "on-off", on_rate: float = 1.8,
           off_rate: float = 0.2,
           period_requests: float = 100.0, system_prompts: int = 4, system_len: int = 256,
           question_len: tuple[int, int] = (16, 64), output_len: int = 64) -> Trace:
    """Chat whose arrivals switch between on and off periods (Poisson at `on_rate` x and `off_rate` x the mean
    rate); each period lasts an exponential time of mean `period_requests` / rate. `arrival` is ignored: the
    on/off process is the point of this workload."""
    rng = random.Random(f"bursty:{seed}")
    systems = [text(rng, system_len) for _ in range(system_prompts)]
    mean_period = period_requests / rate
    times: list[float] = []
    t, on = 0.0, True
    end = rng.expovariate(1.0 / mean_period)
    while len(times) < n:
        r = rate * (on_rate if on else off_rate)
        step = rng.expovariate(r)
        if t + step > end:
            t, on = end, not on
            end = t + rng.expovariate(1.0 / mean_period)
            continue
        t += step
        times.append(t)
    reqs = []
    for i, t in enumerate(times):
        g = rng.randrange(system_prompts)
        reqs.append(TraceRequest(i, t, output_len, g, (("system", systems[g]), ("user", text(rng, rng.randint(*question_len))))))
    return Trace("bursty", seed, rate, tuple(reqs), {"on_rate": on_rate, "off_rate": off_rate,
                                                     "period_requests": period_requests, "system_len": system_len})


def hot_prefix(n: int, rate: float, seed: int, fleet: FleetSpec, *, arrival: str = "poisson", hot_share: float = 0.5,
               cold_prefixes: int = 31, prefix_len: int = 1024, question_len: tuple[int, int] = (32, 96),
               output_len: int = 64) -> Trace:
    """`hot_share` of the traffic shares one prefix; the rest spreads over `cold_prefixes` others."""
    rng = random.Random(f"hot-prefix:{seed}")
    prefixes = [text(rng, prefix_len) for _ in range(cold_prefixes + 1)]
    times = arrivals(rng, rate, n, arrival)
    reqs = []
    for i, t in enumerate(times):
        g = 0 if rng.random() < hot_share else 1 + rng.randrange(cold_prefixes)
        q = text(rng, rng.randint(*question_len))
        reqs.append(TraceRequest(i, t, output_len, g, (("system", prefixes[g]), ("user", q))))
    return Trace("hot-prefix", seed, rate, tuple(reqs), {"hot_share": hot_share, "cold_prefixes": cold_prefixes,
                                                         "prefix_len": prefix_len, "output_len": output_len})


def code(n: int, rate: float, seed: int, fleet: FleetSpec, *, arrival: str = "poisson", context_len: int = 512,
         burst: tuple[int, int] = (4, 8), suffix_len: tuple[int, int] = (16, 48), gap_mean: float = 0.3,
         revisits: int = 4, output_len: int = 32) -> Trace:
    """Completions on file contexts of `context_len` tokens: each editing burst sends several completions on
    one file, each with a different cursor suffix; a file comes back in ~`revisits` bursts."""
    rng = random.Random(f"code:{seed}")
    sizes: list[int] = []
    while sum(sizes) < n:
        sizes.append(rng.randint(*burst))
    files = max(1, len(sizes) // revisits)
    contexts = [text(rng, context_len) + "\n" for _ in range(files)]
    file_of = [rng.randrange(files) for _ in sizes]
    starts = arrivals(rng, rate * len(sizes) / sum(sizes), len(sizes), arrival)
    events = _grouped(rng, starts, sizes, gap_mean)[:n]
    reqs = []
    for i, (t, c, _k) in enumerate(events):
        suffix = text(rng, rng.randint(*suffix_len))
        reqs.append(TraceRequest(i, t, output_len, file_of[c], prompt=(contexts[file_of[c]], suffix),
                                 session=f"edit-{c}"))
    return Trace("code", seed, rate, tuple(reqs), {"context_len": context_len, "burst": list(burst), "files": files,
                                                   "gap_mean": gap_mean, "output_len": output_len})


def summarize(n: int, rate: float, seed: int, fleet: FleetSpec, *, arrival: str = "poisson", doc_len: int = 2048,
              per_doc: int = 4, instruction_len: tuple[int, int] = (24, 48), gap_mean: float = 1.0,
              output_len: int = 128) -> Trace:
    """Documents of `doc_len` tokens, each summarised `per_doc` times with different instructions."""
    rng = random.Random(f"summarize:{seed}")
    docs = math.ceil(n / per_doc)
    starts = arrivals(rng, rate / per_doc, docs, arrival)
    events = _grouped(rng, starts, [per_doc] * docs, gap_mean)[:n]
    texts: dict[int, str] = {}
    reqs = []
    for i, (t, c, _k) in enumerate(events):
        doc = texts.get(c)
        if doc is None:
            doc = texts[c] = text(rng, doc_len)
        instruction = text(rng, rng.randint(*instruction_len))
        reqs.append(TraceRequest(i, t, output_len, c, (("user", doc), ("user", instruction))))
    return Trace("summarize", seed, rate, tuple(reqs), {"doc_len": doc_len, "per_doc": per_doc,
                                                        "gap_mean": gap_mean, "output_len": output_len})


def multi_turn(n: int, rate: float, seed: int, fleet: FleetSpec, *, arrival: str = "poisson", turns: int = 5,
               system_prompts: int = 4, system_len: int = 128, first_len: int = 640, question_len: int = 48,
               think_mean: float = 1.0, output_len: int = 64) -> Trace:
    """Conversations of `turns` turns: each turn is sent `think_mean` (exponential) after the previous answer
    and carries the whole history (~1k tokens on average, growing every turn)."""
    rng = random.Random(f"multi-turn:{seed}")
    systems = [text(rng, system_len) for _ in range(system_prompts)]
    convs = math.ceil(n / turns)
    starts = arrivals(rng, rate / turns, convs, arrival)
    reqs: list[TraceRequest] = []
    for c, t in enumerate(starts):
        g = rng.randrange(system_prompts)
        parent = -1
        for j in range(turns):
            if len(reqs) >= n:
                break
            i = len(reqs)
            if j == 0:
                msgs: tuple[Message, ...] = (("system", systems[g]), ("user", text(rng, first_len)))
                reqs.append(TraceRequest(i, t, output_len, g, msgs, session=f"conv-{c}"))
            else:
                msgs = (("user", text(rng, question_len)),)
                reqs.append(TraceRequest(i, rng.expovariate(1.0 / think_mean), output_len, g, msgs, parent=parent,
                                         session=f"conv-{c}"))
            parent = i
    return Trace("multi-turn", seed, rate, tuple(reqs), {"turns": turns, "system_len": system_len,
                                                         "first_len": first_len, "question_len": question_len,
                                                         "think_mean": think_mean, "output_len": output_len})


def group_sizes(groups: int, prompts_per_group: int, weights: Sequence[float] = ()) -> list[int]:
    """Prompts per group: `prompts_per_group` each, or `groups x prompts_per_group` dealt out by `weights`
    (largest remainders, so the sizes add up exactly)."""
    if not weights:
        return [prompts_per_group] * groups
    if len(weights) != groups or min(weights) <= 0:
        raise ValueError(f"group weights need one positive weight per group ({groups}), got {list(weights)}")
    total = groups * prompts_per_group
    exact = [w * total / sum(weights) for w in weights]
    sizes = [math.floor(x) for x in exact]
    for i in sorted(range(groups), key=lambda i: sizes[i] - exact[i])[: total - sum(sizes)]:
        sizes[i] += 1
    return sizes


def shared_prefix_groups(fleet: FleetSpec, system_prompt_len: int, kv_fill: float) -> int:
    """Groups whose system prompts together fill `kv_fill` of the fleet's KV cache (at least 2)."""
    return max(2, round(kv_fill * fleet.kv_tokens / system_prompt_len))


def shared_prefix(n: int, rate: float, seed: int, fleet: FleetSpec, *, arrival: str = "poisson",
                  system_prompt_len: int = 2048, question_len: int = 256, output_len: int = 64,
                  num_prompts_per_group: int = 8, kv_fill: float = 0.6, num_groups: int | None = None,
                  group_weights: Sequence[float] = ()) -> Trace:
    """inference-perf's shared_prefix data: num_groups x num_prompts_per_group prompts (a group system prompt +
    a unique question), sent in a shuffled order, cycled. By default the system prompts fill `kv_fill` of the
    fleet's KV cache: cache-blind routing then has to keep every prefix on every pod, and thrashes.
    `group_weights` (one per group) makes some prefixes more popular: the same number of prompts in all, dealt
    out in proportion (`group_sizes`)."""
    rng = random.Random(f"shared-prefix:{seed}")
    groups = num_groups if num_groups is not None else shared_prefix_groups(fleet, system_prompt_len, kv_fill)
    pairs = [(g, q) for g, size in enumerate(group_sizes(groups, num_prompts_per_group, group_weights))
             for q in range(size)]
    order: list[tuple[int, int]] = []
    while len(order) < n:
        rng.shuffle(pairs)
        order.extend(pairs)
    times = arrivals(rng, rate, n, arrival)
    # texts only for the prompts this trace uses, each from its own seeded stream (large fleets have ~10^4 groups)
    systems: dict[int, str] = {}
    questions: dict[tuple[int, int], str] = {}
    reqs = []
    for i, (t, (g, q)) in enumerate(zip(times, order, strict=False)):
        if g not in systems:
            systems[g] = text(random.Random(f"shared-prefix:{seed}:{g}"), system_prompt_len)
        if (g, q) not in questions:
            questions[(g, q)] = text(random.Random(f"shared-prefix:{seed}:{g}:{q}"), question_len)
        reqs.append(TraceRequest(i, t, output_len, g, (("system", systems[g]), ("user", questions[(g, q)]))))
    return Trace("shared-prefix", seed, rate, tuple(reqs), {
        "num_groups": groups, "num_prompts_per_group": num_prompts_per_group, "system_prompt_len": system_prompt_len,
        "question_len": question_len, "output_len": output_len, "kv_fill": kv_fill,
        "fleet_kv_tokens": fleet.kv_tokens, "prefix_tokens": groups * system_prompt_len})


def zipf_prefix(n: int, rate: float, seed: int, fleet: FleetSpec, *, arrival: str = "poisson",
                prefix_len: int = 1024, question_len: tuple[int, int] = (32, 96), output_len: int = 64,
                zipf_s: float = 1.0, kv_fill: float = 0.8) -> Trace:
    """Shared prefixes whose popularity follows Zipf's law (the k-th most popular drawn in proportion to 1/k^s),
    as many as fill `kv_fill` of the fleet's KV cache: under cache pressure they fit the fleet only if each is
    held about once, while the few popular ones carry more traffic than one pod can serve. Placing by hash or by
    cache alone fails one way or the other."""
    rng = random.Random(f"zipf-prefix:{seed}")
    groups = shared_prefix_groups(fleet, prefix_len, kv_fill)
    weights = [1.0 / (k + 1) ** zipf_s for k in range(groups)]
    prefixes: dict[int, str] = {}
    times = arrivals(rng, rate, n, arrival)
    reqs = []
    for i, (t, g) in enumerate(zip(times, rng.choices(range(groups), weights, k=n), strict=True)):
        if g not in prefixes:
            prefixes[g] = text(random.Random(f"zipf-prefix:{seed}:{g}"), prefix_len)
        q = text(rng, rng.randint(*question_len))
        reqs.append(TraceRequest(i, t, output_len, g, (("system", prefixes[g]), ("user", q))))
    return Trace("zipf-prefix", seed, rate, tuple(reqs), {"groups": groups, "zipf_s": zipf_s, "prefix_len": prefix_len,
                                                          "kv_fill": kv_fill, "output_len": output_len,
                                                          "fleet_kv_tokens": fleet.kv_tokens})


def imbalance(n: int, rate: float, seed: int, fleet: FleetSpec, *, arrival: str = "poisson", system_prompts: int = 4,
              system_len: int = 256, long_share: float = 0.15, question_len: tuple[int, int] = (16, 64),
              document_len: tuple[int, int] = (1024, 3072), output_len: tuple[int, int] = (16, 64),
              long_output_len: tuple[int, int] = (256, 768)) -> Trace:
    """Chat whose requests differ widely in work: most are short questions with short answers, `long_share` carry
    a document and ask for a long answer. A pod dealt a few long ones stays busy for seconds, so spreading by
    request count is not spreading by work, and a router must see every request in flight on a pod: replicas
    that each count only their own see a quarter of it (four replicas)."""
    rng = random.Random(f"imbalance:{seed}")
    systems = [text(rng, system_len) for _ in range(system_prompts)]
    times = arrivals(rng, rate, n, arrival)
    reqs = []
    for i, t in enumerate(times):
        g = rng.randrange(system_prompts)
        long = rng.random() < long_share
        q = text(rng, rng.randint(*(document_len if long else question_len)))
        out = rng.randint(*(long_output_len if long else output_len))
        reqs.append(TraceRequest(i, t, out, g, (("system", systems[g]), ("user", q))))
    return Trace("imbalance", seed, rate, tuple(reqs), {
        "system_prompts": system_prompts, "system_len": system_len, "long_share": long_share,
        "question_len": list(question_len), "document_len": list(document_len), "output_len": list(output_len),
        "long_output_len": list(long_output_len)})


WORKLOADS: dict[str, WorkloadFn] = {
    "chat": chat,
    "code": code,
    "multi-turn": multi_turn,
    "summarize": summarize,
    "shared-prefix": shared_prefix,
    "bursty": bursty,
    "hot-prefix": hot_prefix,
    "zipf-prefix": zipf_prefix,
    "imbalance": imbalance,
}


def generate(name: str, n: int, rate: float, seed: int, fleet: FleetSpec, **params: Any) -> Trace:
    """The trace of workload `name`: `n` requests at `rate` requests/s (follow-ups included)."""
    fn = WORKLOADS.get(name)
    if fn is None:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    if n <= 0:
        raise ValueError("a trace needs at least one request")
    return fn(n, rate, seed, fleet, **params)
