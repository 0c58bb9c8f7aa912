"""Memory soak of `picker serve`: is the RSS that large bodies and idle streams leave behind retention or growth?

Picker RSS was seen going 91 -> 142 MB after rounds of 16-20 MB bodies and 91 -> 130 MB with 2,000 idle ext_proc
streams, and staying there. A process that only *retains* (allocator caches, high-water marks) levels off once
every kind of load has been seen once; one that *grows* keeps climbing. So the soak repeats one cycle of mixed
load for --duration and compares the picker's RSS after the first cycle (the warm-up) with its RSS after the soak
(load stopped, a quiet period passed): within 20 % passes.

    .venv/bin/python bench/soak.py [--duration 30m] [--cycle 5m] [--sample-interval 30s] [--out bench/out/soak]
    make soak ARGS="--duration 5m"                                     # a quick run (cycle: duration / 3)
    make soak ARGS="--picker-env MALLOC_ARENA_MAX=2 --out bench/out/soak-arena2"

The stack: `picker sim` pods, one `picker serve` (plaintext, --endpoints-file, --max-body-bytes 20Mi) and a real
Envoy (buffered ext_proc, 32 MiB buffer limit), all on free 127.0.0.1 ports. Each cycle runs, over steady chat
traffic through Envoy (distinct prompts behind shared system prompts, so the prefix index fills to its cap;
session ids, so session affinity fills too):
  - two rounds of large bodies through Envoy: 16-20 MB (under the limit: buffered and parsed by the picker), one of
    21 MB with content-length (413 at the headers) and one of 21.3 MB chunked (buffered, then 413 in the picker);
  - idle streams straight at the picker's gRPC port (default 2,000: request headers, then nothing); half are
    cancelled by the client after 20 s, the rest held for 30 % of the cycle (the picker's idle timeout may end
    them first);
  - abandoned streams: direct ones (headers + part of a body, then cancelled) and HTTP clients that send headers
    and part of a body to Envoy and hang up;
  - and it ends with a rest (no load, 30 s), where the cycle's reading is taken: at rest, like the final one.
RSS (VmRSS of /proc/PID/status) is sampled every --sample-interval; soak.json (samples, events, load counts,
summary, allocator reports) and soak.png go to --out. The picker runs under a small probe (this file,
`probe-serve`; --no-probe runs plain `python -m picker serve`): on SIGUSR1 it reports what glibc malloc, pymalloc,
the collector and the memory map hold, at every cycle's end; at the very end it also runs gc.collect() and
malloc_trim(0), so each run tells how much of the final RSS is garbage or free memory the allocator kept. Exit
status 0 when final RSS <= 1.2 x warm-up, 1 otherwise, 2 when the stack failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "out" / "soak"
MIB = 2**20
MAX_BODY = 20 * MIB  # the picker's --max-body-bytes here (its default is 16Mi: most 16-20 MB bodies would be 413)
ENVOY_BUFFER = 32 * MIB  # Envoy's per-connection buffer limit (the template's 16 MiB would 413 them before us)
# Under the limit: buffered by Envoy, sent to the picker, parsed. 21.0 MB with content-length: 413 at the headers.
# 21.3 MB chunked: no length to check, so buffered and sent (under the gRPC limit, max body + 1 MiB), then 413.
LARGE_SIZES = (16_000_000, 17_500_000, 19_000_000, 20_000_000)
OVER_WITH_LENGTH = 21_000_000
OVER_CHUNKED = 21_300_000
LIMIT_RATIO = 1.2


# ---------------------------------------------------------------------------------------------------------------
# The probe: runs inside the picker process (`soak.py probe-serve SERVE-ARGS`), never in the driver.


def _probe_report(libc: Any, directory: Path, label: str, trim: bool) -> dict[str, Any]:
    """What the allocators and the collector hold right now; gc.collect() and malloc_trim(0) first when `trim`."""
    import gc
    import tracemalloc

    report: dict[str, Any] = {"label": label, "time": time.time(), "rss_before_mb": _rss_mb(os.getpid())}
    if trim:  # what the process could give back: its cyclic garbage first, then the allocator's free memory
        report["gc_collected"] = gc.collect()
        report["rss_after_collect_mb"] = _rss_mb(os.getpid())
        report["malloc_trim_returned"] = int(libc.malloc_trim(0))
        report["rss_after_trim_mb"] = _rss_mb(os.getpid())
    report["mallinfo2"] = _mallinfo2(libc)
    xml_path = directory / f"malloc-info-{label}.xml"
    stream = libc.fopen(str(xml_path).encode(), b"w")
    if stream:
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        report["malloc_info"] = _parse_malloc_info(xml_path.read_text())
    report["pymalloc"] = _pymalloc_stats(directory / f"pymalloc-{label}.txt")
    report["smaps"] = _smaps_summary()
    objects = gc.get_objects()
    report["gc_objects"] = len(objects)
    report["gc_top_types"] = Counter(type(o).__name__ for o in objects).most_common(30)
    del objects
    report["allocated_blocks"] = sys.getallocatedblocks()
    with contextlib.suppress(RuntimeError):
        report["asyncio_tasks"] = len(asyncio.all_tasks(asyncio.get_running_loop()))
    if tracemalloc.is_tracing():
        snapshot = tracemalloc.take_snapshot()
        snapshot.dump(str(directory / f"tracemalloc-{label}.pickle"))
        report["tracemalloc_traced_mb"] = round(tracemalloc.get_traced_memory()[0] / MIB, 2)
    return report


def _mallinfo2(libc: Any) -> dict[str, int]:
    import ctypes

    names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
             "keepcost")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in names]

    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return {name: int(getattr(info, name)) for name in names}


def _parse_malloc_info(xml: str) -> dict[str, Any]:
    """Per arena: bytes taken from the system and bytes free inside it (what glibc keeps instead of returning)."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(xml)
    heaps = []
    for heap in root.findall("heap"):
        system = {s.get("type"): int(s.get("size", "0")) for s in heap.findall("system")}
        free = sum(int(t.get("size", "0")) for t in heap.findall("total") if t.get("type") in ("fast", "rest"))
        heaps.append({"nr": int(heap.get("nr", "0")), "system_current": system.get("current", 0),
                      "system_max": system.get("max", 0), "free": free})
    totals = {f"{t.get('type')}": int(t.get("size", "0")) for t in root.findall("total")}
    system = {s.get("type"): int(s.get("size", "0")) for s in root.findall("system")}
    return {"arenas": len(heaps), "heaps": heaps, "totals": totals, "system_current": system.get("current", 0),
            "system_max": system.get("max", 0)}


def _pymalloc_stats(path: Path) -> dict[str, int]:
    """sys._debugmallocstats() writes to C stderr: point fd 2 at a file for the call, then read the totals."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "wb") as handle:
            os.dup2(handle.fileno(), 2)
            try:
                sys._debugmallocstats()
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)
    wanted = {"arenas allocated total": "arenas_allocated_total", "arenas reclaimed": "arenas_reclaimed",
              "arenas highwater mark": "arenas_highwater", "arenas allocated current": "arenas_current",
              "bytes in allocated blocks": "bytes_allocated_blocks", "bytes in available blocks": "bytes_available",
              "bytes lost to pool headers": "bytes_pool_headers", "bytes lost to quantization": "bytes_quantization",
              "bytes lost to arena alignment": "bytes_alignment", "Total": "total"}
    out: dict[str, int] = {}
    for line in path.read_text(errors="replace").splitlines():
        key, _, value = line.partition("=")
        key = key.strip().removeprefix("# ")
        if key in wanted and wanted[key] not in out and value.strip().replace(",", "").isdigit():
            out[wanted[key]] = int(value.strip().replace(",", ""))
        match = re.match(r"(\d+) unused pools \* \d+ bytes", line.strip())
        if match:
            out["unused_pools"] = int(match.group(1))
    return out


def _smaps_summary() -> dict[str, Any]:
    """Resident memory by kind of mapping: files (code, libraries), the brk heap (glibc's main arena), anonymous
    mappings (other glibc arenas, pymalloc arenas, thread stacks, mmapped large blocks)."""
    kinds: Counter[str] = Counter()
    anon: list[tuple[int, int]] = []
    size = name = ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(None, 5)
        if first and "-" in first[0] and len(first) >= 5 and ":" not in first[0]:
            start, end = (int(x, 16) for x in first[0].split("-"))
            size, name = str(end - start), first[5] if len(first) > 5 else ""
        elif line.startswith("Rss:"):
            rss = int(line.split()[1]) * 1024
            kind = "anonymous" if not name else "files" if name.startswith("/") else name
            kinds[kind] += rss
            if not name:
                anon.append((rss, int(size)))
    anon.sort(reverse=True)
    return {"rss_by_kind_mb": {k: round(v / MIB, 1) for k, v in kinds.most_common()},
            "anonymous_mappings": len(anon),
            "largest_anonymous_mb": [[round(r / MIB, 1), round(z / MIB, 1)] for r, z in anon[:10]]}


def probe_serve(argv: list[str]) -> int:
    """`picker serve ARGV` with a SIGUSR1 handler that writes a probe report (SOAK_PROBE_DIR/command.json says
    which label, and whether to malloc_trim first). The picker's own code is untouched."""
    import ctypes
    import ctypes.util

    directory = Path(os.environ["SOAK_PROBE_DIR"])
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]

    def on_signal(signum: int, frame: object) -> None:
        command = json.loads((directory / "command.json").read_text())
        label = str(command["label"])
        try:
            report = _probe_report(libc, directory, label, bool(command.get("trim")))
        except Exception as exc:  # a probe must never take the picker down
            report = {"label": label, "error": repr(exc)}
        partial = directory / f"probe-{label}.json.part"
        partial.write_text(json.dumps(report, indent=1))
        partial.rename(directory / f"probe-{label}.json")

    signal.signal(signal.SIGUSR1, on_signal)
    from picker.cli import main as picker_main

    return picker_main(["serve", *argv])


# ---------------------------------------------------------------------------------------------------------------
# Measuring from outside.


def _rss_mb(pid: int) -> float:
    return _status_kb(pid, "VmRSS") / 1024


def _status_kb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return float(line.split()[1])
    return 0.0


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
            rss, hwm = _rss_mb(self.picker_pid), _status_kb(self.picker_pid, "VmHWM") / 1024
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
        return round(_rss_mb(pid), 1)
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


async def at(soak: Soak, when: float, job: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run `job` at soak time `when` (skipped if the soak is stopping first)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(soak.stopping.wait(), max(0.0, when - soak.now()))
        return
    await job()


async def request_probe(soak: Soak, probe_dir: Path | None, label: str, trim: bool = False) -> dict[str, Any] | None:
    """Ask the probe inside the picker for a report and wait for it."""
    if probe_dir is None:
        return None
    (probe_dir / "command.json").write_text(json.dumps({"label": label, "trim": trim}))
    os.kill(soak.picker_pid, signal.SIGUSR1)
    path = probe_dir / f"probe-{label}.json"
    for _ in range(600):
        if path.exists():
            report: dict[str, Any] = json.loads(path.read_text())
            return report
        await asyncio.sleep(0.1)
    print(f"soak: probe {label!r} did not answer", file=sys.stderr)
    return None


async def run_load(args: argparse.Namespace, soak: Soak, envoy_url: str, envoy_port: int, grpc_port: int,
                   probe_dir: Path | None) -> dict[str, Any]:
    import aiohttp

    duration, cycle, rest = args.duration, args.cycle, args.rest
    cycles = max(1, round(duration / cycle))
    prompts = Prompts(args.seed, args.model)
    filler_words = Prompts(args.seed + 1, args.model).text(64 * 1024).encode()
    filler = (filler_words * (OVER_CHUNKED // len(filler_words) + 2))[:OVER_CHUNKED]
    probes: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=80)) as session, \
            aiohttp.ClientSession(timeout=timeout) as big_session:
        soak.t0 = time.monotonic()
        await asyncio.sleep(args.settle)
        baseline = await soak.sample(session, "baseline (started, no load)")
        probes["baseline"] = await request_probe(soak, probe_dir, "baseline")
        soak.t0 = time.monotonic()  # soak time 0: the load starts
        soak.event("load-start", cycles=cycles, cycle_s=cycle)
        end = cycles * cycle

        async def sampler() -> None:
            while not soak.stopping.is_set() and soak.now() < end:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(soak.stopping.wait(), args.sample_interval)
                if soak.now() < end - 1:
                    await soak.sample(session)

        jobs: list[Coroutine[Any, Any, None]] = [chat_load(soak, session, envoy_url + "/v1/chat/completions",
                                                           prompts, args.rate, end,
                                                           lambda t: t % cycle >= cycle - rest), sampler()]
        cycle_ends: list[Sample] = []
        for c in range(cycles):
            base = c * cycle

            def large(n: int) -> Callable[[], Coroutine[Any, Any, None]]:
                return lambda: large_round(soak, big_session, envoy_url + "/v1/chat/completions", args.model,
                                           filler, n)

            def abandon(n: int) -> Callable[[], Coroutine[Any, Any, None]]:
                return lambda: abandoned_streams(soak, grpc_port, envoy_port, args.abandon_direct,
                                                 args.abandon_envoy, n)

            def idle(n: int) -> Callable[[], Coroutine[Any, Any, None]]:
                return lambda: idle_streams(soak, grpc_port, args.idle_streams, 0.3 * cycle,
                                            min(args.idle_early, 0.3 * cycle), n)

            def rest_start(n: int) -> Callable[[], Coroutine[Any, Any, None]]:
                async def mark() -> None:
                    soak.event("rest", cycle=n)
                return mark

            def cycle_end(n: int) -> Callable[[], Coroutine[Any, Any, None]]:
                async def mark() -> None:
                    label = "warm-up" if n == 0 else f"cycle {n + 1} end"
                    cycle_ends.append(await soak.sample(session, label))
                    probe_label = "warmup" if n == 0 else f"cycle{n + 1}"
                    probes[probe_label] = await request_probe(soak, probe_dir, probe_label)
                return mark

            jobs += [at(soak, base + 0.10 * cycle, abandon(3 * c)), at(soak, base + 0.20 * cycle, large(2 * c)),
                     at(soak, base + 0.40 * cycle, idle(c)), at(soak, base + 0.45 * cycle, abandon(3 * c + 1)),
                     at(soak, base + 0.60 * cycle, large(2 * c + 1)), at(soak, base + 0.80 * cycle, abandon(3 * c + 2)),
                     at(soak, base + cycle - rest, rest_start(c)), at(soak, base + cycle - 0.5, cycle_end(c))]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        soak.event("load-stop")
        quiet_end = soak.now() + args.quiet
        while soak.now() < quiet_end - 0.5:
            await asyncio.sleep(min(args.sample_interval, quiet_end - soak.now()))
            if soak.now() < quiet_end - 0.5:
                await soak.sample(session, "quiet")
        final = await soak.sample(session, "final (after the quiet period)")
        probes["final"] = await request_probe(soak, probe_dir, "final")
        trimmed = None
        if probe_dir is not None:
            probes["trim"] = await request_probe(soak, probe_dir, "trim", trim=True)
            trimmed = await soak.sample(session, "after gc.collect() + malloc_trim(0)")
    warmup = cycle_ends[0]
    ends = [s.rss_mb for s in cycle_ends]
    slope = _slope(list(range(len(ends))), ends) if len(ends) > 2 else None
    loaded = [s for s in soak.samples if 0 <= s.t <= end + 1]
    summary: dict[str, Any] = {
        "baseline_rss_mb": baseline.rss_mb,
        "warmup_rss_mb": warmup.rss_mb,
        "peak_rss_mb": max(max(s.rss_mb for s in loaded), final.hwm_mb),
        "peak_sampled_rss_mb": max(s.rss_mb for s in loaded),
        "final_rss_mb": final.rss_mb,
        "final_over_warmup": round(final.rss_mb / warmup.rss_mb, 3),
        "limit": LIMIT_RATIO,
        "passed": final.rss_mb <= LIMIT_RATIO * warmup.rss_mb,
        "after_collect_rss_mb": round((probes.get("trim") or {}).get("rss_after_collect_mb") or 0, 1) or None,
        "gc_collected": (probes.get("trim") or {}).get("gc_collected"),
        "after_trim_rss_mb": trimmed.rss_mb if trimmed else None,
        "cycle_end_rss_mb": ends,
        "cycle_end_growth_mb_per_cycle": round(slope, 2) if slope is not None else None,
        "index_entries_final": final.index_entries,
        "in_flight_final": final.in_flight,
    }
    summary["allocators"] = [_allocator_row(label, report) for label, report in probes.items() if report]
    if probe_dir is not None and args.tracemalloc:
        summary["tracemalloc_growth_warmup_to_final"] = _tracemalloc_diff(probe_dir, "warmup", "final")
        summary["tracemalloc_growth_cycle2_to_final"] = _tracemalloc_diff(probe_dir, "cycle2", "final")
    return {"summary": summary, "probes": probes}


def _allocator_row(label: str, report: dict[str, Any]) -> dict[str, Any]:
    """One line per probe: where the RSS sits (MB) and what is in use vs merely kept."""
    info, py = report.get("mallinfo2", {}), report.get("pymalloc", {})
    smaps = report.get("smaps", {}).get("rss_by_kind_mb", {})
    return {"probe": label, "rss_mb": round(report.get("rss_after_trim_mb") or report.get("rss_before_mb", 0), 1),
            "glibc_in_use_mb": round(info.get("uordblks", 0) / MIB, 1),
            "glibc_free_kept_mb": round(info.get("fordblks", 0) / MIB, 1),
            "glibc_arenas": report.get("malloc_info", {}).get("arenas"),
            "pymalloc_arenas_mb": round(py.get("total", 0) / MIB, 1),
            "pymalloc_blocks_mb": round(py.get("bytes_allocated_blocks", 0) / MIB, 1),
            "python_blocks": report.get("allocated_blocks"), "gc_objects": report.get("gc_objects"),
            "rss_heap_mb": smaps.get("[heap]"), "rss_anonymous_mb": smaps.get("anonymous"),
            "rss_files_mb": smaps.get("files")}


def _slope(xs: list[int], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def _tracemalloc_diff(directory: Path, old: str, new: str) -> list[str]:
    import tracemalloc

    try:
        before = tracemalloc.Snapshot.load(str(directory / f"tracemalloc-{old}.pickle"))
        after = tracemalloc.Snapshot.load(str(directory / f"tracemalloc-{new}.pickle"))
    except OSError:
        return []
    return [str(stat) for stat in after.compare_to(before, "lineno")[:25]]


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = [s for s in result["samples"] if s["t"] >= 0]
    summary = result["summary"]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    minutes = [s["t"] / 60 for s in samples]
    ax.plot(minutes, [s["rss_mb"] for s in samples], "o-", ms=3, label="picker RSS (VmRSS)")
    opened = {e["batch"]: e["t"] for e in result["events"] if e["kind"] == "idle-open"}
    for e in result["events"]:
        if e["kind"] == "idle-cancel" and e["batch"] in opened:
            ax.axvspan(opened[e["batch"]] / 60, e["t"] / 60, color="tab:orange", alpha=0.12,
                       label="idle streams held" if e["batch"] == 0 else None)
        elif e["kind"] == "large":
            ax.axvline(e["t"] / 60, color="tab:red", alpha=0.35, lw=1,
                       label="large-body round" if e["round"] == 0 else None)
        elif e["kind"] == "abandon":
            ax.axvline(e["t"] / 60, color="tab:green", alpha=0.25, lw=1, ls=":",
                       label="abandoned streams" if e["batch"] == 0 else None)
        elif e["kind"] == "rest":
            ax.axvspan(e["t"] / 60, (e["t"] + result["config"]["rest_s"]) / 60, color="grey", alpha=0.15,
                       label="rest (no load): cycle readings" if e["cycle"] == 0 else None)
        elif e["kind"] == "load-stop":
            ax.axvline(e["t"] / 60, color="black", lw=1, ls="--", label="load stops")
    warm = summary["warmup_rss_mb"]
    ax.axhline(warm, color="tab:blue", ls="--", lw=1, label=f"warm-up {warm:.0f} MB")
    ax.axhline(warm * LIMIT_RATIO, color="tab:red", ls="--", lw=1, label=f"limit 1.2 x warm-up ({warm * 1.2:.0f})")
    ax.axhline(summary["baseline_rss_mb"], color="grey", ls=":", lw=1,
               label=f"before load {summary['baseline_rss_mb']:.0f} MB")
    if summary.get("after_trim_rss_mb"):
        ax.plot([minutes[-1]], [summary["after_trim_rss_mb"]], "v", color="tab:purple",
                label=f"after gc.collect() + malloc_trim(0): {summary['after_trim_rss_mb']:.0f} MB")
    ax.set_ylabel("RSS (MB)")
    env = " ".join(result["config"]["picker_env"]) or "default allocator settings"
    ax.set_title(f"picker soak: {result['config']['duration_s'] / 60:.0f} min, final {summary['final_rss_mb']:.0f} MB "
                 f"= {summary['final_over_warmup']:.2f} x warm-up ({env})")
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    entries = [(m, s["index_entries"] / 1000) for m, s in zip(minutes, samples, strict=True)
               if s["index_entries"] is not None]
    if entries:
        ax2.plot([m for m, _ in entries], [v for _, v in entries], "-", color="tab:gray")
    ax2.set_ylabel("prefix index\n(k entries)")
    ax2.set_xlabel("minutes since the load started")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                            "libc": " ".join(platform.libc_ver())}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        info["mem_total_mb"] = round(_status_like("/proc/meminfo", "MemTotal") / 1024)
    with contextlib.suppress(Exception):
        import grpc

        info["grpcio"] = grpc.__version__
    return info


def _status_like(path: str, key: str) -> float:
    for line in Path(path).read_text().splitlines():
        if line.startswith(key + ":"):
            return float(line.split()[1])
    return 0.0


def start_stack(args: argparse.Namespace, logdir: Path, started: list[Any], probe_dir: Path | None
                ) -> tuple[Any, Any, Any]:
    """Sim pods, the picker (plaintext ext_proc on loopback) and Envoy in front of it, on free ports."""
    from picker.serving.envoyconfig import EnvoySettings, envoy_binary, render
    from picker_lab.supervisor import Envoy, Picker, free_port, port_open, spawn, start_sim, wait_until

    sim = start_sim(args.pods, logdir, extra=["--seed", "1"])
    started.append(sim.process)
    endpoints_file = logdir / "endpoints.yaml"
    endpoints_file.write_text("".join(f"- {a}\n" for a in sim.addresses))
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    serve = ["--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
             "--metrics-port", str(metrics_port), "--seed", "7", "--endpoints-file", str(endpoints_file),
             "--max-body-bytes", str(MAX_BODY), "--log-level", "WARNING"]
    help_text = subprocess.run([sys.executable, "-m", "picker", "serve", "--help"], capture_output=True, text=True,
                               check=True).stdout
    tls = "--secure-serving" in help_text
    if tls:  # the direct streams speak plaintext gRPC, as a sidecar Envoy on loopback would
        serve.append("--secure-serving=false")
    command = ([sys.executable, str(Path(__file__).resolve()), "probe-serve", *serve] if probe_dir is not None
               else [sys.executable, "-m", "picker", "serve", *serve])
    env = dict(kv.split("=", 1) for kv in args.picker_env)
    if probe_dir is not None:
        env["SOAK_PROBE_DIR"] = str(probe_dir)
    if args.tracemalloc:
        env["PYTHONTRACEMALLOC"] = "1"
    process = spawn("picker", command, logdir, env=env)
    started.append(process)
    wait_until(lambda: port_open(health_port) and port_open(grpc_port), 30, "picker", process.proc)
    picker = Picker(grpc_port, health_port, metrics_port, process, endpoints_file)
    wanted: dict[str, Any] = {"listen_port": free_port(), "admin_port": free_port(), "picker_port": grpc_port,
                              "picker_health_port": health_port, "pool": tuple(sim.addresses), "mode": "buffered",
                              "buffer_bytes": ENVOY_BUFFER, "picker_tls": "plaintext"}
    known = {f.name for f in dataclasses.fields(EnvoySettings)}
    settings = EnvoySettings(**{k: v for k, v in wanted.items() if k in known})
    config_path = logdir / "envoy.yaml"
    config_path.write_text(render(settings))
    envoy_process = spawn("envoy", [envoy_binary(), "-c", str(config_path), "--base-id",
                                    str(40_000 + os.getpid() % 20_000), "-l", "warning", "--concurrency", "1"],
                          logdir)
    started.append(envoy_process)
    envoy = Envoy(settings.listen_port, settings.admin_port, envoy_process, config_path, settings)
    wait_until(lambda: port_open(settings.listen_port), 30, "envoy", envoy_process.proc)
    wait_until(envoy.picker_healthy, 30, "envoy sees the picker healthy", envoy_process.proc)
    return sim, picker, envoy


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["probe-serve"]:
        return probe_serve(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=parse_duration, default=parse_duration("30m"),
                        help="load time, e.g. 30m, 5m, 90s (default 30m)")
    parser.add_argument("--cycle", type=parse_duration, default=None,
                        help="one cycle of the load mix; the first is the warm-up (default min(5m, duration/3))")
    parser.add_argument("--sample-interval", type=parse_duration, default=30.0, help="RSS sampling (default 30s)")
    parser.add_argument("--quiet", type=parse_duration, default=60.0, help="after the load, before the final "
                        "reading (default 60s)")
    parser.add_argument("--rest", type=parse_duration, default=None,
                        help="no load at the end of every cycle, so each cycle's reading is at rest like the final "
                        "one (default min(30s, cycle/10))")
    parser.add_argument("--settle", type=parse_duration, default=10.0, help="idle time before the baseline")
    parser.add_argument("--rate", type=float, default=12.0, help="chat requests per second (default 12)")
    parser.add_argument("--pods", type=int, default=4, help="simulated vLLM pods (default 4)")
    parser.add_argument("--idle-streams", type=int, default=2000, help="idle ext_proc streams per cycle")
    parser.add_argument("--idle-early", type=parse_duration, default=20.0,
                        help="half the idle streams are cancelled after this (default 20s), the rest after 30 %% of "
                        "the cycle")
    parser.add_argument("--abandon-direct", type=int, default=40, help="abandoned direct streams per batch")
    parser.add_argument("--abandon-envoy", type=int, default=20, help="abandoned HTTP requests per batch")
    parser.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--picker-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment of the picker process, e.g. MALLOC_ARENA_MAX=2 (repeatable)")
    parser.add_argument("--tracemalloc", action="store_true",
                        help="run the picker with PYTHONTRACEMALLOC=1 and report the Python allocations that grew "
                        "from warm-up to the end (slower, and tracing itself costs memory)")
    parser.add_argument("--no-probe", action="store_true",
                        help="run plain `python -m picker serve` (no allocator report, no malloc_trim reading)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if any("=" not in kv for kv in args.picker_env):
        parser.error("--picker-env takes KEY=VALUE")
    if args.cycle is None:
        args.cycle = min(300.0, args.duration / 3)
    if args.cycle > args.duration:
        parser.error("--cycle is longer than --duration")
    if args.rest is None:
        args.rest = min(30.0, args.cycle / 10)
    if args.rest >= 0.2 * args.cycle:
        parser.error("--rest must be under a fifth of the cycle (the last abandoned batch runs at 80 %)")

    from picker_lab.supervisor import process_scope

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds through process_scope, which stops every child

    signal.signal(signal.SIGTERM, on_term)
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    from picker.core.distribution import git_commit

    commit = git_commit(HERE)  # now: the checkout may change while the soak runs
    try:
        with process_scope("soak") as (logdir, started):
            probe_dir = None if args.no_probe else logdir / "probe"
            if probe_dir is not None:
                probe_dir.mkdir()
            print(f"soak: logs in {logdir}", flush=True)
            sim, picker, envoy = start_stack(args, logdir, started, probe_dir)
            soak = Soak(picker.process.proc.pid, envoy.process.proc.pid, sim.process.proc.pid,
                        f"http://127.0.0.1:{picker.metrics_port}/metrics")
            try:
                outcome = asyncio.run(run_load(args, soak, envoy.url, envoy.port, picker.grpc_port, probe_dir))
            except Exception as exc:
                print(f"soak: failed: {exc!r}\n--- picker log (tail) ---\n{picker.process.log()[-3000:]}",
                      file=sys.stderr)
                return 2
            if probe_dir is not None:
                for name in os.listdir(probe_dir):  # keep the allocator dumps next to the figures
                    if name.endswith((".xml", ".txt")):
                        (args.out / name).write_bytes((probe_dir / name).read_bytes())
    except KeyboardInterrupt:
        print("soak: interrupted; every child stopped", file=sys.stderr)
        return 130
    result = {
        "config": {"duration_s": args.duration, "cycle_s": args.cycle, "cycles": max(1, round(args.duration /
                   args.cycle)), "sample_interval_s": args.sample_interval, "quiet_s": args.quiet, "rest_s": args.rest,
                   "chat_rate": args.rate, "pods": args.pods, "idle_streams": args.idle_streams,
                   "abandon_direct": args.abandon_direct, "abandon_envoy": args.abandon_envoy,
                   "large_sizes": LARGE_SIZES, "over_with_length": OVER_WITH_LENGTH, "over_chunked": OVER_CHUNKED,
                   "max_body_bytes": MAX_BODY, "envoy_buffer_bytes": ENVOY_BUFFER, "picker_env": args.picker_env,
                   "tracemalloc": args.tracemalloc, "probe": not args.no_probe},
        "machine": machine(), "commit": commit, "started": time.strftime("%Y-%m-%d %H:%M:%S",
                                                                                time.localtime(began)),
        "wall_s": round(time.time() - began),
        "summary": outcome["summary"],
        "load": {group: dict(c) for group, c in soak.counts.items()},
        "samples": [dataclasses.asdict(s) for s in soak.samples],
        "events": soak.events,
        "probes": outcome["probes"],
    }
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "soak.png")
    s = result["summary"]
    print(json.dumps({"load": result["load"]}, indent=1))
    print(f"soak: before load {s['baseline_rss_mb']} MB, warm-up {s['warmup_rss_mb']} MB, peak {s['peak_rss_mb']} MB, "
          f"final {s['final_rss_mb']} MB = {s['final_over_warmup']} x warm-up "
          f"({'pass' if s['passed'] else 'FAIL'}: limit {LIMIT_RATIO}); after gc.collect() "
          f"{s['after_collect_rss_mb']} MB, + malloc_trim(0) {s['after_trim_rss_mb']} MB; cycle ends "
          f"{s['cycle_end_rss_mb']}")
    for row in s["allocators"]:
        print("soak: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    print(f"soak: wrote {args.out / 'soak.json'} and {args.out / 'soak.png'}")
    return 0 if s["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
