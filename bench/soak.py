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
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from picker_lab.bench.memory_probe import allocator_row, tracemalloc_diff
from picker_lab.bench.soak_load import (
    ENVOY_BUFFER,
    LARGE_SIZES,
    MAX_BODY,
    OVER_CHUNKED,
    OVER_WITH_LENGTH,
    Prompts,
    Sample,
    Soak,
    abandoned_streams,
    chat_load,
    idle_streams,
    large_round,
    parse_duration,
)

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "out" / "soak"
LIMIT_RATIO = 1.2


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
    summary["allocators"] = [allocator_row(label, report) for label, report in probes.items() if report]
    if probe_dir is not None and args.tracemalloc:
        summary["tracemalloc_growth_warmup_to_final"] = tracemalloc_diff(probe_dir, "warmup", "final")
        summary["tracemalloc_growth_cycle2_to_final"] = tracemalloc_diff(probe_dir, "cycle2", "final")
    return {"summary": summary, "probes": probes}


def _slope(xs: list[int], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def plot(result: dict[str, Any], path: Path) -> None:
    from picker_lab.bench.plots import pyplot

    plt = pyplot()

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
    command = ([sys.executable, "-P", "-m", "picker_lab.bench.memory_probe", *serve] if probe_dir is not None
               else [sys.executable, "-P", "-m", "picker", "serve", *serve])
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
