"""Open-loop streaming HTTP client: replays a trace against a URL and measures on the client side.

Each request is sent at its trace time (follow-ups: think time after the parent's answer arrived) whether or not
earlier ones finished, streamed with SSE; TTFT is the first chunk carrying text, ITL the mean gap between
text chunks, prompt/cached/output tokens come from the final usage chunk. Times are wall seconds x
`time_scale`, i.e. model seconds, comparable with fast mode.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from picker_lab.bench.oracle import InfiniteCacheOracle
from picker_lab.bench.prompts import PromptBuilder, http_body
from picker_lab.bench.results import FAILED, OK, SHED, RunResult
from picker_lab.bench.trace import Message, Trace

POD_HEADER = "x-sim-pod"
# What the benchmarks' Envoys add to every response for engines that do not name themselves (real vLLM): the
# address of the pod that answered (supervisor.start_envoy's `served_by`).
SERVED_BY_HEADER = "x-served-by"


async def stream_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
               ) -> dict[str, Any]:
    """Send one streaming request; returns timings (monotonic seconds), status, usage, text and pod name."""
    sent = time.monotonic()
    out: dict[str, Any] = {"sent": sent, "first": None, "first_chunk": None, "last": None, "chunks": 0, "text": [],
                           "usage": None}
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            out["status"] = resp.status
            out["pod"] = resp.headers.get(POD_HEADER) or resp.headers.get(SERVED_BY_HEADER, "")
            if resp.status != 200:
                await resp.read()
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    out["usage"] = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    if out["first_chunk"] is None:  # a token came back, even if it decodes to no text yet
                        out["first_chunk"] = time.monotonic()
                    piece = choice.get("text")
                    if piece is None:
                        piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        now = time.monotonic()
                        if out["first"] is None:
                            out["first"] = now
                        out["last"] = now
                        out["chunks"] += 1
                        out["text"].append(piece)
            out["done"] = time.monotonic()
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        out["status"] = -1
        out["error"] = repr(exc)
    return out


async def replay(base_url: str, trace: Trace, strategy: str, *, pods: int, model: str, time_scale: float = 1.0,
                 progress: Callable[[int], None] | None = None, concurrency_limit: int = 2000,
                 timeout_s: float = 600.0, builder: PromptBuilder | None = None,
                 oracle: InfiniteCacheOracle | None = None) -> RunResult:
    """Replay `trace` against `base_url`; the returned RunResult has client-side per-request columns filled
    (pod counters, load series and hit-rate counters are added by the caller from the pods' /metrics)."""
    res = RunResult("live", trace.workload, strategy, pods, len(trace))
    res.allocate()
    children = trace.children()
    history: dict[int, tuple[Message, ...]] = {}
    served = [0] * pods
    errors: list[str] = []
    connector = aiohttp.TCPConnector(limit=concurrency_limit, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    start = time.monotonic()
    scale = time_scale
    pending: set[asyncio.Task[None]] = set()

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def send(i: int, at_wall: float) -> None:
            delay = at_wall - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            r = trace.requests[i]
            messages = None
            if r.is_chat:
                messages = (*history.pop(r.parent), *r.messages) if r.parent >= 0 else r.messages
            body = http_body(model, r, messages)
            ids: list[int] = []
            hashes: list[int] = []
            if oracle is not None and builder is not None:
                ids = builder.chat_ids(messages or ()) if r.is_chat else builder.completion_ids(r.prompt or ())
                hits_before = oracle.hits
                hashes = oracle.on_send(ids)
                res.oracle_cached[i] = oracle.hits - hits_before
            path = "/v1/chat/completions" if r.is_chat else "/v1/completions"
            headers = {"x-session-id": r.session} if r.session else {}
            got = await stream_request(session, base_url + path, body, headers)
            res.sent[i] = (got["sent"] - start) * scale
            status = got.get("status", -1)
            if status == 429:
                res.status[i] = SHED
            elif status != 200 or got["first"] is None:
                res.status[i] = FAILED
                if len(errors) < 5:
                    errors.append(f"request {i}: status {status} {got.get('error', '')}".strip())
            else:
                res.status[i] = OK
                res.ttft[i] = (got["first"] - got["sent"]) * scale
                res.e2e[i] = (got["done"] - got["sent"]) * scale
                usage = got["usage"] or {}
                out_tokens = int(usage.get("completion_tokens") or got["chunks"])
                res.output_tokens[i] = out_tokens
                res.prompt_tokens[i] = int(usage.get("prompt_tokens") or 0)
                details = usage.get("prompt_tokens_details") or {}
                res.cached_tokens[i] = int(details.get("cached_tokens") or 0)
                if got["chunks"] > 1:
                    res.itl[i] = (got["last"] - got["first"]) / (got["chunks"] - 1) * scale
                if oracle is not None and builder is not None:
                    answer = builder.tokenizer.encode("".join(got["text"]), add_special_tokens=False)
                    oracle.on_finish(hashes, ids + answer)
                pod = got.get("pod", "")
                if pod.startswith("sim-") and pod[4:].isdigit() and int(pod[4:]) < pods:
                    res.pod[i] = int(pod[4:])
                    served[int(pod[4:])] += 1
            kids = children.get(i)
            if kids:
                if r.is_chat and messages is not None:
                    history[i] = (*messages, ("assistant", "".join(got["text"])))
                for c in kids:
                    if res.status[i] != OK:  # the conversation ends with a failed turn
                        history.pop(i, None)
                        _skip(res, c, children)
                        continue
                    _spawn(send(c, time.monotonic() + trace.requests[c].at / scale))
            if progress is not None:
                progress(1)

        def _spawn(coro: Any) -> None:
            task = asyncio.ensure_future(coro)
            pending.add(task)
            task.add_done_callback(pending.discard)

        for r in trace.requests:
            if r.parent < 0:
                _spawn(send(r.index, start + r.at / scale))
        while pending:
            await asyncio.gather(*list(pending))
    res.pod_served = served
    if oracle is not None:
        res.oracle_queries, res.oracle_hits = oracle.queries, oracle.hits
    res.notes.extend(errors)
    sent = [t for t in res.sent if not math.isnan(t)]
    ends = [s + e for s, e in zip(res.sent, res.e2e, strict=True) if not math.isnan(e)]
    res.duration_s = (max(ends) - min(sent)) if ends and sent else 0.0
    res.wall_s = time.monotonic() - start
    return res


def _skip(res: RunResult, index: int, children: dict[int, list[int]]) -> None:
    """A follow-up that can never be sent (its parent failed) counts as failed, with its own follow-ups."""
    res.status[index] = FAILED
    for c in children.get(index, ()):
        _skip(res, c, children)
