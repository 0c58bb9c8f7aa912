"""The soak's load and what it reads from outside the picker (bench/soak.py runs them): steady chat, rounds of
large bodies, idle and abandoned ext_proc streams; the picker's RSS and counters sampled as they go."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from picker_lab.bench.memory_probe import MIB, rss_mb, status_kb

MAX_BODY = 20 * MIB  # the picker's --max-body-bytes here (its default is 16Mi: most 16-20 MB bodies would be 413)
ENVOY_BUFFER = 32 * MIB  # Envoy's per-connection buffer limit (the template's 16 MiB would 413 them before us)
# Under the limit: buffered by Envoy, sent to the picker, parsed. 21.0 MB with content-length: 413 at the headers.
# 21.3 MB chunked: no length to check, so buffered and sent (under the gRPC limit, max body + 1 MiB), then 413.
LARGE_SIZES = (16_000_000, 17_500_000, 19_000_000, 20_000_000)
OVER_WITH_LENGTH = 21_000_000
OVER_CHUNKED = 21_300_000

# ---------------------------------------------------------------------------------------------------------------
# Measuring from outside.


def parse_duration(text: str) -> float:
    """"30m", "90s", "1h", "1h30m", "2.5m" or plain seconds."""
    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30m, 90s, 1h)")
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(n) * scale[u] for n, u in parts)


@dataclass
class Sample:
    t: float
    rss_mb: float
    hwm_mb: float
    index_entries: float | None = None
    in_flight: float | None = None
    envoy_rss_mb: float | None = None
    sim_rss_mb: float | None = None
    label: str = ""


@dataclass
class Soak:
    """Shared state of one run: the clock, what happened when, and what the load got back."""

    picker_pid: int
    envoy_pid: int
    sim_pid: int
    metrics_url: str
    t0: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, Counter[str]] = field(default_factory=dict)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def event(self, kind: str, **detail: Any) -> None:
        self.events.append({"t": round(self.now(), 1), "kind": kind, **detail})

    def count(self, group: str, outcome: str, n: int = 1) -> None:
        self.counts.setdefault(group, Counter())[outcome] += n

    async def sample(self, session: Any, label: str = "") -> Sample:
        entries = in_flight = None
        with contextlib.suppress(Exception):
            async with session.get(self.metrics_url, timeout=5) as response:
                text = await response.text()
            entries = _metric_sum(text, "inference_extension_prefix_indexer_size")
            in_flight = _metric_sum(text, "picker_endpoint_in_flight_requests")
        try:
            rss, hwm = rss_mb(self.picker_pid), status_kb(self.picker_pid, "VmHWM") / 1024
        except OSError:
            rss = hwm = 0.0
        if not rss:  # gone, or a zombie (no VmRSS line)
            raise RuntimeError("the picker process is gone")
        s = Sample(round(self.now(), 1), round(rss, 1), round(hwm, 1), entries, in_flight,
                   _maybe_rss(self.envoy_pid), _maybe_rss(self.sim_pid), label)
        self.samples.append(s)
        print(f"[soak {s.t:7.0f}s] picker RSS {s.rss_mb:6.1f} MB (peak {s.hwm_mb:.1f}), index "
              f"{s.index_entries if s.index_entries is not None else '?'} entries {label}", flush=True)
        return s


def _maybe_rss(pid: int) -> float | None:
    try:
        return round(rss_mb(pid), 1)
    except OSError:
        return None


def _metric_sum(text: str, name: str) -> float | None:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and (line[len(name)] in " {")]
    return sum(values) if values else None


# ---------------------------------------------------------------------------------------------------------------
# Load.


class Prompts:
    """Distinct prompts behind a few shared system prompts (the shape that fills the prefix index)."""

    def __init__(self, seed: int, model: str) -> None:
        self.rng = random.Random(seed)
        self.model = model
        letters = "abcdefghijklmnopqrstuvwxyz"
        self.words = ["".join(self.rng.choice(letters) for _ in range(self.rng.randint(2, 9))) for _ in range(3000)]
        self.systems = [f"You are assistant {i}. " + self.text(1500) for i in range(16)]
        self.seq = 0

    def text(self, chars: int) -> str:
        out: list[str] = []
        n = 0
        while n < chars:
            word = self.rng.choice(self.words)
            out.append(word)
            n += len(word) + 1
        return " ".join(out)

    def chat(self) -> tuple[bytes, dict[str, str]]:
        self.seq += 1
        rng = self.rng
        stream = rng.random() < 0.5
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": rng.randint(4, 24), "stream": stream,
            "messages": [{"role": "system", "content": rng.choice(self.systems)},
                         {"role": "user", "content": f"request {self.seq}: " + self.text(rng.randint(1000, 4000))}]}
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        headers = {"content-type": "application/json"}
        if rng.random() < 0.4:
            headers["x-session-id"] = f"s{rng.randrange(50_000)}"
        return json.dumps(body).encode(), headers


def large_body(size: int, tag: str, model: str, filler: bytes) -> bytes:
    """A chat body of exactly `size` bytes. `n: 0`: the pod refuses it (400) before tokenizing 4M tokens; the
    picker does not look at `n`, so it buffers, decodes, parses and routes the whole body all the same."""
    head = b'{"model": "' + model.encode() + b'", "n": 0, "max_tokens": 8, "messages": [{"role": "user", ' \
        b'"content": "' + tag.encode() + b" "
    tail = b'"}]}'
    return head + filler[: size - len(head) - len(tail)] + tail


async def chat_load(soak: Soak, session: Any, url: str, prompts: Prompts, rate: float, until: float,
                    resting: Callable[[float], bool]) -> None:
    """Poisson arrivals at `rate`/s, none while `resting(now)`; at most 64 outstanding (a request beyond that is
    counted, not sent)."""
    import aiohttp

    outstanding: set[asyncio.Task[None]] = set()
    rng = random.Random(11)

    async def one(body: bytes, headers: dict[str, str]) -> None:
        try:
            async with session.post(url, data=body, headers=headers) as response:
                await response.read()
                soak.count("chat", str(response.status))
        except (aiohttp.ClientError, TimeoutError) as exc:
            soak.count("chat", type(exc).__name__)

    while soak.now() < until and not soak.stopping.is_set():
        await asyncio.sleep(rng.expovariate(rate))
        if resting(soak.now()):
            continue
        if len(outstanding) >= 64:
            soak.count("chat", "skipped (64 outstanding)")
            continue
        task = asyncio.create_task(one(*prompts.chat()))
        outstanding.add(task)
        task.add_done_callback(outstanding.discard)
    if outstanding:
        await asyncio.wait(outstanding, timeout=60)


async def large_round(soak: Soak, session: Any, url: str, model: str, filler: bytes, round_no: int) -> None:
    """Four bodies under the limit, one over it with content-length, one over it chunked; two at a time."""
    import aiohttp

    soak.event("large", round=round_no)
    jobs: list[tuple[int, bool]] = [(s, True) for s in LARGE_SIZES] + [(OVER_WITH_LENGTH, True),
                                                                          (OVER_CHUNKED, False)]
    limit = asyncio.Semaphore(2)

    async def chunks(body: bytes) -> AsyncIterator[bytes]:
        for i in range(0, len(body), MIB):
            yield body[i : i + MIB]

    async def one(i: int, size: int, with_length: bool) -> None:
        async with limit:
            body = large_body(size, f"large-{round_no}-{i}", model, filler)
            kind = f"{size / 1e6:.1f}MB{'' if with_length else ' chunked'}"
            try:
                data: Any = body if with_length else chunks(body)
                async with session.post(url, data=data, headers={"content-type": "application/json"}) as response:
                    text = await response.read()
                    code = "picker" if b"body_too_large" in text else "pod" if response.status == 400 else ""
                    soak.count("large", f"{kind}: {response.status}{' ' + code if code else ''}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                soak.count("large", f"{kind}: {type(exc).__name__}")
            del body

    await asyncio.gather(*(one(i, size, wl) for i, (size, wl) in enumerate(jobs)))


def _headers_message(content_length: int, mode: str, request_id: str) -> Any:
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED if mode == "full-duplex" else pm.ProcessingMode.BUFFERED
    values = {":method": "POST", ":path": "/v1/chat/completions", ":authority": "soak", "content-type":
              "application/json", "content-length": str(content_length), "x-request-id": request_id}
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]), end_of_stream=False),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=body_mode, response_body_mode=pm.ProcessingMode.NONE))


def _channels(port: int, count: int) -> list[Any]:
    """Separate HTTP/2 connections (a local subchannel pool each), as several Envoy workers would hold."""
    import grpc

    return [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1),
                                                                     ("grpc.max_send_message_length", 64 * MIB)])
            for _ in range(count)]


async def idle_streams(soak: Soak, port: int, count: int, hold: float, early: float, batch: int) -> None:
    """`count` ext_proc streams that send request headers (a body announced) and then nothing, as an Envoy whose
    clients stall would leave them. Half are cancelled by the client after `early` seconds (under the picker's
    --stream-idle-timeout, 30 s by default), the others held for `hold` seconds, so the picker's idle timeout
    ends them first if it is shorter; how each ended is counted."""
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    channels = _channels(port, 4)
    calls: list[Any] = []
    opened = Counter[str]()
    limit = asyncio.Semaphore(100)

    async def open_one(i: int) -> None:
        async with limit:
            call = pb_grpc.ExternalProcessorStub(channels[i % len(channels)]).Process()
            calls.append(call)
            try:
                await call.write(_headers_message(2000, "buffered", f"idle-{batch}-{i}"))
                await asyncio.wait_for(call.read(), 20)
                opened["open"] += 1
            except Exception as exc:
                opened[type(exc).__name__] += 1

    try:
        soak.event("idle-open", batch=batch, streams=count)
        await asyncio.gather(*(open_one(i) for i in range(count)))
        soak.event("idle-held", batch=batch, **opened)
        for outcome, n in opened.items():
            soak.count("idle streams", outcome, n)
        t_open = soak.now()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(soak.stopping.wait(), early)
        for call in calls[::2]:
            soak.count("idle streams", "cancelled by the client" if call.cancel() else await _ended(call))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(soak.stopping.wait(), max(0.0, hold - (soak.now() - t_open)))
        for call in calls[1::2]:
            soak.count("idle streams", "cancelled by the client" if call.cancel() else await _ended(call))
    finally:
        for call in calls:
            call.cancel()
        soak.event("idle-cancel", batch=batch)
        for channel in channels:
            await channel.close()


async def _ended(call: Any) -> str:
    """How a stream the client could no longer cancel had ended (the picker's status code)."""
    try:
        code = await asyncio.wait_for(call.code(), 5)
    except Exception as exc:
        return f"ended: {type(exc).__name__}"
    return f"ended by the picker: {getattr(code, 'name', code)}"


async def abandoned_streams(soak: Soak, port: int, envoy_port: int, direct: int, via_envoy: int, batch: int
                            ) -> None:
    """Direct streams: headers and part of the body (buffered or full-duplex), then the client goes away.
    Through Envoy: an HTTP/1.1 client sends headers and part of a body, then closes its socket."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    soak.event("abandon", batch=batch)
    rng = random.Random(batch)
    channels = _channels(port, 2)
    chunk = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * (256 * 1024)

    async def direct_one(i: int) -> None:
        mode = "full-duplex" if i % 2 else "buffered"
        call = pb_grpc.ExternalProcessorStub(channels[i % 2]).Process()
        try:
            await call.write(_headers_message(3_000_000, mode, f"abandon-{batch}-{i}"))
            if mode == "buffered":
                await asyncio.wait_for(call.read(), 20)
            for _ in range(rng.randint(1, 3)):
                await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=False)))
                if mode == "buffered":
                    await asyncio.wait_for(call.read(), 20)
            await asyncio.sleep(rng.uniform(0.2, 1.5))
            soak.count("abandoned", f"direct {mode}")
        except Exception as exc:
            soak.count("abandoned", f"direct {mode}: {type(exc).__name__}")
        finally:
            call.cancel()

    async def envoy_one(i: int) -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", envoy_port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n"
                         b"content-length: 4000000\r\n\r\n" + chunk * rng.randint(1, 4))
            await writer.drain()
            await asyncio.sleep(rng.uniform(0.2, 1.5))
            writer.transport.abort()  # a reset, not a polite close
            soak.count("abandoned", "via envoy")
        except OSError as exc:
            soak.count("abandoned", f"via envoy: {type(exc).__name__}")

    try:
        await asyncio.gather(*(direct_one(i) for i in range(direct)), *(envoy_one(i) for i in range(via_envoy)))
    finally:
        for channel in channels:
            await channel.close()


# ---------------------------------------------------------------------------------------------------------------
# The run.


