"""`picker bench`: compare routing strategies on the same traces and fleet; writes report.json/.md and plots."""

from __future__ import annotations

import argparse
import inspect
import json
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from picker.core.argtypes import positive_number, whole_number
from picker.scheduling.config import STRATEGIES
from picker.serving.config import parse_duration
from picker_lab.bench import peers
from picker_lab.bench.workloads import WORKLOADS, FleetSpec, generate

if TYPE_CHECKING:
    from picker_lab.bench.real import RealSpec

FAST_STRATEGIES = ("round-robin", "random", "least-load", "prefix-only", "picker")
# Default output root, relative to the working directory (the repository root under `make bench`).
OUT_ROOT = Path("bench") / "out"


# Routers as gateways run them, through what production goes through (picker_lab.bench.fleet)
FLEET_SCENARIOS = ("replicas", "router-restart", "pod-restart", "valkey-outage")


def _csv(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(s) for s in _csv(text))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `picker bench`."""
    a = parser.add_argument
    a("--scenario", choices=("routing", "mixed-models", "overload", "token-fairness", "pd", "scale",
                             *FLEET_SCENARIOS),
      default="routing",
      help="routing: the workloads and strategies below (default); mixed-models: two base models on disjoint sim "
      "pods plus adapters, round-robin vs the picker per model (~12 min; --repeats, --rate, --profile apply); "
      "overload: flow control at 0.5x, 2x and 6.6x the fleet's capacity (--mode fast: seconds, live: ~20 min; "
      "--strategies picks the pickers, --phase, --pods, --max-num-seqs, --seed and --repeats apply); token-fairness: "
      "flow control sharing turns by requests vs by tokens while a heavy tenant sends 10x the tokens of three light "
      "ones at 2x capacity (--mode fast: a minute, live: ~6 min per repeat; --phase, --pods, --max-num-seqs, --seed, "
      "--repeats); pd: prefill/"
      "decode disaggregation against aggregated serving at equal pod count (fast mode, ~12 min; --pods, --requests, "
      "--profile, --seed and --repeats apply); scale: one picker process's decision time, decisions/s, scrape and "
      "index cost at 64-4,000 pods, and what sampling pods costs in routing (~8 min; --requests: timed decisions per "
      "size); replicas, router-restart, pod-restart, valkey-outage: routers as gateways run them (NAME@N replicas "
      "behind one load balancer, live mode, --live-* flags, --strategies and --peers apply) with steady traffic, "
      "their replicas restarted one at a time, a pod restarted, the picker's Valkey away 30 s (--repeats "
      "interleaved, default 3; see lab/picker_lab/bench/fleet.py)")
    a("--phase", type=parse_duration, default=None, help="--scenario overload: length of each phase (default 40s)")
    a("--max-num-seqs", type=whole_number(1), default=None, help="--scenario overload: sequences per pod (default 8)")
    a("--kept-slot-share", type=float, default=0.1, help="--scenario token-fairness: the share of the running slots "
      "the bound keeps for the light tenants")
    a("--max-num-batched-tokens", type=whole_number(1), default=None, help="--scenario token-fairness: the pods' "
      "prefill chunk (default: the profile's 8,192)")
    a("--replicas", type=whole_number(1), default=None, help="--scenario overload: picker replicas behind Envoy (default 1); more "
      "than one runs each picker with each replica counting only its own requests and with the replicas sharing "
      "their in-flight counts (live: through a local Valkey)")
    a("--engine", choices=("sim", "vllm"), default="sim",
      help="sim: the simulator (default); vllm: real vLLM CPU servers (make bench-real; ~40 minutes)")
    a("--repeats", type=whole_number(1), default=None, help="--engine vllm: runs per strategy, each on fresh servers unless "
      "--reuse-servers (default 3); "
      "--scenario mixed-models: runs per router (default 2); --scenario overload: fast-mode seeds (default 10)")
    a("--reuse-servers", action="store_true", help="--engine vllm: start the servers once, settle them with "
      "unmeasured round-robin passes of the trace, and empty their prefix caches between runs (vLLM's reset "
      "endpoint) instead of fresh servers per run: ~3x the repeats in the same time, every router on the same "
      "processes (not with a pod leaving); repeat r replays the trace of --seed + r, as fresh servers' new ports "
      "would re-place the hash routers' prefixes")
    a("--picker-args", default=None, help="--engine vllm: extra `picker serve` flags for the picker strategies")
    a("--candidate-args", default=None, help="--engine vllm: `picker serve` flags for the picker-candidate strategy "
                                             "(a change measured beside the defaults in the same run)")
    a("--model-shape", default=None, help="--engine vllm: the served random-weight Llama, small (default) or "
      "medium (~12x the compute per token by its shape: loads a fast machine's engines at the workloads' rates)")
    a("--mode", choices=("fast", "live", "both"), default=None,
      help="fast: in-process discrete-event simulation (default); live: real sim fleet + Envoy + routers")
    a("--smoke", action="store_true", help="a ~1-minute reduced fast run plus a short live run")
    a("--workload", "--workloads", dest="workloads", type=_csv, default=None,
      help=f"comma-separated workloads (default all: {', '.join(WORKLOADS)}; --engine vllm: one of uniform, "
      "pressure, hot, multi-turn, leave-rejoin, default uniform)")
    a("--strategies", type=_csv, default=None, help=f"comma-separated strategies (default {', '.join(FAST_STRATEGIES)})")
    a("--pods", type=whole_number(1), default=None, help="fast-mode fleet size (default 8)")
    a("--profile", default="llama3-8b-h100", help="simulator profile (picker_lab.sim.profiles)")
    a("--num-gpu-blocks", type=whole_number(1), default=None, help="override the profile's KV-cache blocks per pod")
    a("--load", type=positive_number, default=None, help="offered load as a fraction of cache-blind capacity (default 0.8)")
    a("--rate", type=positive_number, default=None, help="offered requests/s (overrides --load)")
    a("--requests", type=whole_number(1), default=None, help="requests per workload and strategy (default 4000; --engine vllm: "
      "the workload's preset, scaled by more prompts per prefix)")
    a("--seed", type=int, default=1, help="seed of every trace and tie-break")
    a("--arrival", choices=("poisson", "ramp"), default="poisson", help="open-loop arrival process")
    a("--out", default=None, help="output directory (default bench/out/<timestamp> under the working directory)")
    a("--jobs", type=whole_number(0), default=0, help="worker processes for fast mode (default: CPU count)")
    a("--sweep-loads", type=_floats, default=None, help="loads of the sweep (default 0.5,0.7,0.85,1.0,1.15)")
    a("--sweep-workloads", type=_csv, default=None, help="workloads of the sweep (default shared-prefix,multi-turn)")
    a("--sweep-requests", type=whole_number(1), default=None, help="requests per sweep point (default 2000)")
    a("--capacity-workload", default=None, help="workload of the smallest-fleet search ('' to skip)")
    a("--capacity-requests", type=whole_number(1), default=None, help="requests per smallest-fleet try (default 1500)")
    a("--ttft-target", type=positive_number, default=None, help="p95 TTFT target (s) of the smallest-fleet search")
    a("--adaptive-scrape", action="store_true",
      help="fast mode: scrape on picker serve's adaptive cadence (1 s calm, 100 ms busy) instead of every 50 ms")
    a("--scrape-cost", type=parse_duration, default=0.0,
      help="fast mode: time one scrape holds a pod's API server, e.g. 6ms as measured on vLLM (default 0: free)")
    a("--scheduling", default=None, help="YAML/JSON scheduler config for the full picker (as picker serve reads it)")
    a("--workload-param", dest="workload_params", action="append", default=[], metavar="WORKLOAD.KEY=VALUE",
      help="fast mode: one of a workload's generator parameters, e.g. zipf-prefix.kv_fill=0.5 (repeatable)")
    a("--live-workload", default="shared-prefix", help="live-mode workload")
    a("--live-pods", type=whole_number(1), default=None, help="live-mode fleet size (default 4)")
    a("--live-requests", type=whole_number(1), default=None, help="live-mode requests per strategy (default 400)")
    a("--live-load", type=positive_number, default=None, help="live-mode load (default 0.8)")
    a("--live-time-scale", type=positive_number, default=None,
      help="model seconds per wall second in live mode (default 0.5: half speed keeps 2 cores ahead of the load)")
    a("--peers", type=_csv, default=None, help=f"peer routers in live mode (default {','.join(peers.PEERS)}; 'none'); "
      "NAME@N runs N replicas behind one Envoy round-robin, smg-mesh@N syncs their trees through smg's mesh, and "
      "picker@N (in --strategies) shares the index and load through a Valkey")


def _scheduling(path: str | None) -> dict[str, Any] | None:
    if not path:
        return None
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: scheduler config must be a mapping")
    return data.get("scheduling", data)


def workload_params(items: list[str]) -> dict[str, dict[str, Any]]:
    """`WORKLOAD.KEY=VALUE` flags as {workload: {key: value}}: the workload must exist and its generator take KEY;
    VALUE is read as JSON (a number, a list, true/false), else kept as text."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, eq, raw = item.partition("=")
        workload, dot, key = name.partition(".")
        if not eq or not dot or not key:
            raise ValueError(f"--workload-param {item!r}: expected WORKLOAD.KEY=VALUE")
        generator = WORKLOADS.get(workload)
        if generator is None:
            raise ValueError(f"--workload-param {item!r}: unknown workload {workload!r} (known: {', '.join(WORKLOADS)})")
        known = [p for p in inspect.signature(generator).parameters.values()
                 if p.kind is p.KEYWORD_ONLY and p.name != "arrival"]  # --arrival sets that one
        if key not in {p.name for p in known}:
            raise ValueError(f"--workload-param {item!r}: {workload} has no parameter {key!r} "
                             f"(it takes {', '.join(p.name for p in known)})")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.setdefault(workload, {})[key] = value
    return out


def fast_spec(args: argparse.Namespace) -> Any:
    """The FastSpec the flags ask for (smoke: small fleet, small caches, few requests)."""
    from picker_lab.bench.suite import FastSpec

    smoke = args.smoke
    overrides: dict[str, Any] = {}
    if args.num_gpu_blocks or smoke:
        overrides["num_gpu_blocks"] = args.num_gpu_blocks or 2500
    scheduling = _scheduling(args.scheduling)
    strategies = tuple(s for s in (args.strategies or FAST_STRATEGIES) if not peers.is_peer(s))
    for s in strategies:
        if s not in STRATEGIES:
            raise ValueError(f"unknown strategy {s!r} (fast mode knows {', '.join(FAST_STRATEGIES)})")
    workloads = args.workloads or tuple(WORKLOADS)
    for w in workloads:
        if w not in WORKLOADS:
            raise ValueError(f"unknown workload {w!r} (known: {', '.join(WORKLOADS)})")
    cap = args.capacity_workload if args.capacity_workload is not None else "shared-prefix"
    sweep_w = args.sweep_workloads if args.sweep_workloads is not None else (
        ("shared-prefix",) if smoke else ("shared-prefix", "multi-turn"))
    spec = FastSpec(
        profile=args.profile,
        profile_overrides=tuple(overrides.items()),
        pods=args.pods or (4 if smoke else 8),
        workloads=workloads,
        strategies=strategies,
        load=args.load if args.load is not None else 0.8,
        rate=args.rate,
        requests=args.requests or (600 if smoke else 4000),
        seed=args.seed,
        arrival=args.arrival,
        scheduling=json.dumps(scheduling) if scheduling else "",
        sweep_loads=args.sweep_loads or ((0.6, 1.0) if smoke else (0.5, 0.7, 0.85, 1.0, 1.15)),
        sweep_workloads=tuple(w for w in sweep_w if w),
        sweep_requests=args.sweep_requests or (300 if smoke else 2000),
        capacity_workload=cap or None,
        capacity_requests=args.capacity_requests or (300 if smoke else 1500),
        ttft_target=args.ttft_target,
        jobs=args.jobs,
        adaptive_scrape=args.adaptive_scrape,
        scrape_cost=args.scrape_cost,
        workload_params=json.dumps(params) if (params := workload_params(args.workload_params)) else "",
    )
    fleet = FleetSpec(spec.get_profile(), spec.pods)
    for workload, given in params.items():
        try:  # a value of the wrong kind fails here, not in a worker process minutes later
            generate(workload, 2, 1.0, spec.seed, fleet, **given)
        except (TypeError, ValueError) as exc:
            shown = ", ".join(f"{k}={v!r}" for k, v in given.items())
            raise ValueError(f"--workload-param {workload}: {shown} refused: {exc}") from exc
    return spec


def run(args: argparse.Namespace) -> int:
    """Entry point called by `picker bench`."""
    mode = args.mode or ("both" if args.smoke else "fast")
    out = Path(args.out) if args.out else OUT_ROOT / time.strftime("%Y%m%d-%H%M%S")
    command = "picker bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["bench"] else \
        "picker bench (programmatic)"
    from picker_lab.bench import report

    if args.engine == "vllm":
        return run_real(args, out)
    vllm_only = [flag for flag, value in (("--model-shape", args.model_shape), ("--picker-args", args.picker_args),
                                          ("--candidate-args", args.candidate_args),
                                          ("--reuse-servers", args.reuse_servers or None)) if value is not None]
    if vllm_only:
        print(f"picker bench: {', '.join(vllm_only)}: only with --engine vllm (the real-engine benchmark)", file=sys.stderr)
        return 2
    if args.scenario == "mixed-models":
        return run_mixed_models(args, out)
    if args.scenario == "overload":
        return run_overload(args, mode, out)
    if args.scenario == "token-fairness":
        return run_token_fairness(args, mode, out)
    if args.scenario == "pd":
        return run_disaggregation(args, out)
    if args.scenario == "scale":
        return run_scale_scenario(args, out)
    if args.scenario in FLEET_SCENARIOS:
        return run_fleet(args, out)
    fast = None
    live = None
    try:
        if mode in ("fast", "both"):
            from picker_lab.bench.suite import run_suite

            spec = fast_spec(args)
            print(f"picker bench: fast mode, {len(spec.workloads)} workloads x {len(spec.strategies)} strategies, "
                  f"{spec.pods} pods, {spec.requests} requests each -> {out}", file=sys.stderr)
            fast = run_suite(spec)
        if mode in ("live", "both"):
            from picker_lab.bench.live import LiveSpec, run_live

            live_spec = LiveSpec.from_args(args)
            print(f"picker bench: live mode, {live_spec.workload}, {live_spec.pods} pods, {live_spec.requests} "
                  f"requests per strategy -> {out}", file=sys.stderr)
            live = run_live(live_spec, out)
    except ValueError as exc:
        print(f"picker bench: {exc}", file=sys.stderr)
        return 2
    result = report.build(out, command, fast, live)
    print((out / "report.md").read_text())
    print(f"picker bench: wrote {out / 'report.json'}, {out / 'report.md'} and {len(result['plots'])} plots",
          file=sys.stderr)
    missed = [t for t in (result.get("fast") or {}).get("targets", []) + (result.get("live") or {}).get("targets", [])
              if not t["met"]]
    if missed:
        print(f"picker bench: {len(missed)} target(s) missed (see report.md)", file=sys.stderr)
    return 0


def real_spec(args: argparse.Namespace) -> RealSpec:
    """The real-engine run the flags ask for; ValueError names a flag that does not fit."""
    from picker_lab.bench.real import REAL_WORKLOADS, RealSpec

    workloads = args.workloads or ("uniform",)
    if len(workloads) != 1:
        raise ValueError(f"--engine vllm runs one workload at a time ({', '.join(REAL_WORKLOADS)})")
    if args.scheduling:  # fast and live modes build the scheduler in-process; here it is `picker serve`'s
        raise ValueError("--scheduling is for the fast and live modes; with --engine vllm give picker serve its "
                         "config: --picker-args '--config-file FILE'")
    spec = RealSpec.for_workload(workloads[0], **({"strategies": args.strategies} if args.strategies else {}),
                                 repeats=args.repeats or 3, seed=args.seed,
                                 **({"rate": args.rate} if args.rate else {}),
                                 picker_args=tuple(shlex.split(args.picker_args or "")),
                                 candidate_args=tuple(shlex.split(args.candidate_args or "")),
                                 reuse_servers=args.reuse_servers, seed_per_repeat=args.reuse_servers,
                                 **({"model": args.model_shape} if args.model_shape else {}))
    return spec.with_requests(args.requests) if args.requests else spec


def run_real(args: argparse.Namespace, out: Path) -> int:
    """`--engine vllm`: the real-engine benchmark (picker_lab.bench.real)."""
    from picker_lab.bench.real import run_real

    try:
        spec = real_spec(args)
        print(f"picker bench: real vLLM, workload {spec.workload}, {spec.servers} servers ({spec.model} model), "
              f"{', '.join(spec.strategies)}, {spec.repeats} repeats -> {out}", file=sys.stderr)
        section = run_real(spec, out)
    except ValueError as exc:
        print(f"picker bench: {exc}", file=sys.stderr)
        return 2
    print((out / "real.md").read_text())
    missed = [t for t in section["targets"] if not t["met"]]
    if missed:
        print(f"picker bench: {len(missed)} target(s) missed (see real.md)", file=sys.stderr)
    return 0


def run_mixed_models(args: argparse.Namespace, out: Path) -> int:
    """`--scenario mixed-models` (picker_lab.bench.mixed)."""
    from picker_lab.bench.mixed import MixedSpec, run_mixed

    spec = MixedSpec(profile=args.profile, repeats=args.repeats or 2, seed=args.seed,
                     **({"rate": args.rate} if args.rate else {}))
    run_mixed(spec, out)
    print((out / "mixed.md").read_text())
    return 0


def run_overload(args: argparse.Namespace, mode: str, out: Path) -> int:
    """`--scenario overload` (picker_lab.bench.overload)."""
    from picker_lab.bench.overload import MAX_NUM_SEQS, PICKERS, OverloadSpec, run_overload

    spec = OverloadSpec(pods=args.pods or 2, phase_s=args.phase or 40.0, seed=args.seed, repeats=args.repeats or 10,
                        pickers=args.strategies or tuple(name for name, _ in PICKERS),
                        max_num_seqs=args.max_num_seqs or MAX_NUM_SEQS, replicas=args.replicas or 1)
    try:
        run_overload(spec, ("fast", "live") if mode == "both" else (mode,), out)
    except ValueError as exc:
        print(f"picker bench: {exc}", file=sys.stderr)
        return 2
    print((out / "overload.md").read_text())
    return 0


def run_token_fairness(args: argparse.Namespace, mode: str, out: Path) -> int:
    """`--scenario token-fairness` (picker_lab.bench.token_fairness)."""
    from picker_lab.bench.token_fairness import TokenFairnessSpec, run_token_fairness

    spec = TokenFairnessSpec(pods=args.pods or 2, phase_s=args.phase or 40.0, seed=args.seed,
                             repeats=args.repeats or 3, max_num_seqs=args.max_num_seqs or 64,
                             kept_slot_share=args.kept_slot_share, max_num_batched_tokens=args.max_num_batched_tokens)
    run_token_fairness(spec, ("fast", "live") if mode == "both" else (mode,), out)
    print((out / "token-fairness.md").read_text())
    return 0


def run_disaggregation(args: argparse.Namespace, out: Path) -> int:
    """`--scenario pd` (picker_lab.bench.disagg)."""
    from picker_lab.bench.disagg import PdSpec, run_pd

    repeats = args.repeats or 2
    spec = PdSpec(profile=args.profile, pods=args.pods or 4, requests=args.requests or 1500,
                  seeds=tuple(range(args.seed, args.seed + repeats)))
    run_pd(spec, out)
    print((out / "pd.md").read_text())
    return 0


def run_fleet(args: argparse.Namespace, out: Path) -> int:
    """`--scenario replicas|router-restart|pod-restart|valkey-outage` (picker_lab.bench.fleet)."""
    from picker_lab.bench.fleet import ScenarioSpec, run_scenario
    from picker_lab.bench.live import LiveSpec

    spec = ScenarioSpec(LiveSpec.from_args(args), args.scenario, repeats=args.repeats or 3)
    try:
        run_scenario(spec, out)
    except ValueError as exc:
        print(f"picker bench: {exc}", file=sys.stderr)
        return 2
    print((out / "fleet.md").read_text())
    return 0


def run_scale_scenario(args: argparse.Namespace, out: Path) -> int:
    """`--scenario scale` (picker_lab.bench.scale)."""
    from picker_lab.bench.scale import ScaleSpec, run_scale

    run_scale(ScaleSpec(decisions=args.requests or 2000, seed=args.seed), out)
    print((out / "scale.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m picker_lab.bench.cli` (same flags as `picker bench`)."""
    parser = argparse.ArgumentParser(prog="picker bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
