"""`picker sim`: run N simulated vLLM servers in one process until SIGINT/SIGTERM (`--engine`: whose metric pages
they serve, so a picker can be tried against SGLang's or TensorRT-LLM's names too)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

from picker.core.argtypes import port_or_off, positive_number, whole_number
from picker.serving.config import parse_duration
from picker_lab.sim.dialects import DIALECTS
from picker_lab.sim.fleet import SimFleet
from picker_lab.sim.profiles import DEFAULT_PROFILE, PROFILES, get_profile
from picker_lab.sim.server import PodBindError


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `picker sim`."""
    a = parser.add_argument
    a("--pods", type=whole_number(1), default=1, help="number of simulated vLLM instances (default %(default)s)")
    a("--base-port", type=port_or_off, default=8000,
      help="pod i listens on base-port + i; 0 picks free ports (default %(default)s)")
    a("--first-pod", type=whole_number(0), default=0,
      help="number of the first pod's name (sim-N): pods of one fleet run by several processes keep distinct names, "
           "so one of them can be restarted on its own (default %(default)s)")
    a("--host", default="127.0.0.1", help="listen address (default %(default)s)")
    a("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES),
      help="hardware/model profile (default %(default)s)")
    a("--model", default=None, help="served model name (default: the profile's model)")
    a("--time-scale", type=positive_number, default=1.0,
      help="model time runs this many times faster than wall time (default %(default)s)")
    a("--seed", type=int, default=0, help="seed of the generated text (default %(default)s)")
    a("--lora-modules", nargs="*", type=_lora_module, default=[], metavar="NAME=PATH",
      help="LoRA adapters the pods serve (default: none)")
    a("--kv-events-endpoint", default=None, metavar="tcp://HOST:PORT",
      help="publish KV events to this one endpoint, every pod under its own topic kv@<host>:<port>@<model> (the "
      "consumer binds: give `picker serve --kv-events-endpoint` the same value; default: no KV events)")
    a("--kv-events-endpoint-base", default=None, metavar="tcp://HOST:PORT",
      help="publish KV events, pod i to PORT + i under the topic kv-events (a consumer per pod; default: none)")
    a("--kv-events-bind-port", type=port_or_off, default=0, metavar="PORT",
      help="each pod binds its KV-event publisher on tcp://<--host>:PORT, as vLLM's tcp://*:PORT on a pod; for "
      "`picker serve --kv-events-port PORT` (one pod per host address; default: 0, none)")
    a("--kv-events-replay-port-base", type=port_or_off, default=0, metavar="PORT",
      help="pod i serves KV-event replays on PORT + i, as vLLM's replay_endpoint (default: none)")
    a("--num-gpu-blocks", type=whole_number(1), default=None, help="override the KV cache size (default: the profile's)")
    a("--num-cpu-blocks", type=whole_number(0), default=None,
      help="KV offloading to host memory: this many blocks (vLLM's OffloadingConnector, CPU tier; its KV events "
      "carry medium CPU; default: the profile's, none)")
    a("--block-size", type=whole_number(1), default=None, help="override the KV block size (default: the profile's)")
    a("--max-num-seqs", type=whole_number(1), default=None,
      help="override the most sequences a pod runs at once (default: the profile's)")
    a("--max-num-batched-tokens", type=whole_number(1), default=None,
      help="override the token budget of one step (default: the profile's)")
    a("--max-model-len", type=whole_number(1), default=None, help="override the context window (default: the profile's)")
    a("--max-loras", type=whole_number(0), default=None, help="override the number of LoRA slots (default: the profile's)")
    a("--scrape-cost", type=parse_duration, default=None,
      help="model time one GET /metrics holds a pod's API server (delays its request intake and tokens), "
      "e.g. 6ms as measured on a real vLLM (default: 0, free)")
    a("--eos-mean-tokens", type=whole_number(1), default=None,
      help="mean output length before a pseudo-EOS (default: the profile's)")
    a("--data-parallel-size", type=whole_number(1), default=1, metavar="N",
      help="each pod is a server of N data-parallel ranks behind its one port, as vLLM's --data-parallel-size: N "
      "engines, each its own KV cache, a request going to the rank its X-data-parallel-rank names or else balanced "
      "as vLLM does; one metrics page with each engine's series labelled engine=\"0\".. (vLLM's metrics); with KV "
      "events, rank r publishes on the endpoint's port + r as vLLM does; GET /sim/ranks counts each rank's "
      "requests and cache hits (default %(default)s)")
    a("--engine", default="vllm", choices=DIALECTS,
      help="whose metric names the pods serve: vllm or sglang on /metrics; trtllm on /prometheus/metrics as "
      "trtllm-serve does (its gauges as of the last finished request) and its JSON iteration stats on /metrics "
      "(default %(default)s)")


async def _serve(args: argparse.Namespace) -> int:
    if args.data_parallel_size > 1 and args.engine != "vllm":
        print("picker sim: --data-parallel-size: a data-parallel pod serves vLLM's metrics (--engine vllm)",
              file=sys.stderr)
        return 2
    if args.data_parallel_size > 1 and (args.kv_events_endpoint_base or args.kv_events_replay_port_base
                                        and args.pods > 1):
        # rank r of a data-parallel pod publishes (and replays) on its port + r, as vLLM offsets it: with a port
        # per pod counted up from a base, pod 0's rank 1 and pod 1's rank 0 would share one
        print("picker sim: --data-parallel-size: each rank publishes on its port + its rank, so pods numbered from "
              "--kv-events-endpoint-base (or several pods' --kv-events-replay-port-base) would collide; give "
              "--kv-events-endpoint or --kv-events-bind-port, one pod per host address for replays",
              file=sys.stderr)
        return 2
    profile = get_profile(args.profile).with_overrides(
        num_gpu_blocks=args.num_gpu_blocks,
        num_cpu_blocks=args.num_cpu_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_loras=args.max_loras,
        eos_mean_tokens=args.eos_mean_tokens,
        scrape_cost_s=args.scrape_cost,
    )
    fleet = SimFleet(
        args.pods,
        host=args.host,
        base_port=args.base_port,
        profile=profile,
        time_scale=args.time_scale,
        model=args.model,
        lora_modules=dict(args.lora_modules),
        seed=args.seed,
        kv_events_endpoint_base=args.kv_events_endpoint_base,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_port_base=args.kv_events_replay_port_base,
        kv_events_bind_port=args.kv_events_bind_port,
        engine=args.engine,
        first_index=args.first_pod,
        data_parallel_size=args.data_parallel_size,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with fleet:
        for pod in fleet.pods:
            kv = f" kv-events={pod.config.kv_events_endpoint}" if pod.config.kv_events_endpoint else ""
            dp = f" data-parallel-size={args.data_parallel_size}" if args.data_parallel_size > 1 else ""
            print(f"{pod.name} {pod.url} model={pod.model_name} profile={profile.name} engine={args.engine}{kv}{dp}",
                  flush=True)
        await stop.wait()
    return 0


def run(args: argparse.Namespace) -> int:
    """Entry point called by `picker sim`."""
    try:
        return asyncio.run(_serve(args))
    except PodBindError as exc:  # the fleet has stopped the pods it started
        print(f"picker sim: {_bind_message(args, exc)}", file=sys.stderr)
        return 2


def _bind_message(args: argparse.Namespace, exc: PodBindError) -> str:
    """Name the flag the user can change: --base-port (pod i is base + i), or --host when ports were free."""
    if exc.bad_host or not args.base_port:
        return f"--host {args.host}: {exc.reason}"
    if exc.port == args.base_port:
        return f"--base-port {args.base_port}: {exc.reason}"
    return f"--base-port {args.base_port}: port {exc.port} ({exc.pod}): {exc.reason}"
