# Two commands do everything from a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/picker/api/v1/*.proto)
GENERATED := $(patsubst protos/%.proto,%_pb2.py,$(PROTOS))

.PHONY: install protos demo test lint bench bench-smoke bench-fleet bench-real real-report scrape-cost tokenize-cost validate-sim overhead soak upload-memory overload token-fairness scale pd pd-real mixed-models precise-scenarios cache-tiers fuzzy-prefix kv-events-real dp-real media-real media-peers clean

# The picker with the dev extra (tools, Envoy, Valkey), and the lab beside it (lab/: the simulator, the
# benchmarks, the demo), both editable. The picker's install compiles the protos too (setup.py's build hook).
$(STAMP): pyproject.toml setup.py lab/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]' -e './lab[bench]'
	touch $(STAMP)

install: $(STAMP) protos

# Our own gRPC API, compiled with grpcio-tools (the dev extra; a build dependency of the package, whose wheel and
# sdist builds compile it themselves); generated code is never committed. Re-run after editing a .proto.
protos: $(GENERATED)
picker/api/v1/%_pb2.py: protos/picker/api/v1/%.proto $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $<

# Options go through ARGS, e.g. `make demo ARGS="--once --pods 5"` (`picker demo --help` lists them).
demo: install
	$(BIN)/picker demo $(ARGS)

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: install
	$(BIN)/ruff check picker lab tests bench
	$(BIN)/mypy picker lab/picker_lab tests bench

bench: install
	$(BIN)/picker bench --mode fast

bench-smoke: install
	$(BIN)/picker bench --smoke

# Fleet scenarios (live mode, 8 simulated pods, 3 interleaved repeats each; lab/picker_lab/bench/fleet.py): the replicated
# routers under steady traffic (shared-prefix, multi-turn, zipf-prefix: cache pressure), a rolling restart of their replicas, a pod
# restarting, the picker's Valkey away for 30 s (~110 min in all); reports in bench/out/fleet-<scenario>.
FLEET_ROUTERS ?= picker@4,hash-ring@4,smg@4,smg-mesh@4
# the other peers, one tree per replica as smg@4 without its mesh: in steady traffic only (the run's length)
FLEET_STEADY_PEERS ?= vllm-router@4,sglang-router@4
bench-fleet: install
	$(BIN)/picker bench --scenario valkey-outage --live-pods 8 --strategies picker@4 \
	  --out bench/out/fleet-valkey-outage $(ARGS)
	$(BIN)/picker bench --scenario pod-restart --live-pods 8 --strategies $(FLEET_ROUTERS) \
	  --out bench/out/fleet-pod-restart $(ARGS)
	for w in shared-prefix multi-turn zipf-prefix; do $(BIN)/picker bench --scenario replicas --live-pods 8 \
	  --live-requests 400 --live-workload $$w --strategies picker,$(FLEET_ROUTERS),$(FLEET_STEADY_PEERS) \
	  --out bench/out/fleet-replicas-$$w $(ARGS) || exit 1; done
	$(BIN)/picker bench --scenario router-restart --live-pods 8 --strategies $(FLEET_ROUTERS) \
	  --out bench/out/fleet-router-restart $(ARGS)

overhead: install
	$(BIN)/python bench/overhead.py

# Real vLLM CPU servers (installed into bench/.venvs/vllm on first use): round-robin, the hash baselines and the
# picker on one workload (WORKLOAD=uniform, pressure, hot, multi-turn or leave-rejoin), 3 interleaved repeats, ~45 minutes each.
# More flags through ARGS, e.g. ARGS="--strategies picker,hash-ring --repeats 1"; OUT=dir for the results.
WORKLOAD ?= uniform
OUT ?= bench/out/real-$(WORKLOAD)
bench-real: install
	$(BIN)/picker bench --engine vllm --workload $(WORKLOAD) --out $(OUT) $(ARGS)

# A bench-real run's report re-rendered from its real.json (seconds), e.g. `make real-report OUT=bench/out/real-hot
# ARGS=--sim` (the simulator's mirror again) or ARGS="--merge dir1 dir2 --drop 1 --why '...'" (runs combined).
real-report: install
	$(BIN)/python bench/real_report.py $(OUT) $(ARGS)

# CPU and token delay one /metrics scrape costs a real vLLM server, ~8 minutes.
scrape-cost: install
	$(BIN)/python bench/scrape_cost.py

# Where the approximate prefix index is wrong (bypass, two pickers, misreported KV) and what KV events buy (fast, ~3 min).
precise-scenarios: install
	$(BIN)/python bench/precise_scenarios.py $(ARGS)

# Routing by cache tier (host-memory offloading) against counting every tier the same (fast mode, 3 seeds, ~5 min).
cache-tiers: install
	$(BIN)/python bench/cache_tiers.py $(ARGS)

# Fuzzy prefix matching (MinHash-LSH) with and without, prompts differing early and late (fast mode, ~20 s).
fuzzy-prefix: install
	$(BIN)/python bench/fuzzy_prefix.py $(ARGS)

# Prefill/decode disaggregation on two real vLLM CPU servers through Envoy, picker and pd-sidecar (~5 minutes).
pd-real: install
	$(BIN)/python bench/pd_real.py $(ARGS)

# The precise view against one real vLLM CPU server's KV events (~3 minutes).
kv-events-real: install
	$(BIN)/python bench/kv_events_real.py $(ARGS)

# A real vLLM CPU server of two data-parallel ranks: does a prefix stay on its rank (~3 minutes)?
dp-real: install
	$(BIN)/python bench/data_parallel_real.py $(ARGS)

# Images on two real vLLM CPU servers of a small multimodal model: its token count, routing by image (~3 minutes).
media-real: install
	$(BIN)/python bench/media_real.py $(ARGS)

# The routers in front of two real vLLM servers of a small multimodal model under load (~9 minutes a repeat, 3 repeats).
media-peers: install
	$(BIN)/python bench/media_peers.py $(ARGS)

# What precise routing's POST /tokenize per request costs a real vLLM server, ~5 minutes.
tokenize-cost: install
	$(BIN)/python bench/tokenize_cost.py $(ARGS)

validate-sim: install
	$(BIN)/python bench/validate_sim.py

# Memory soak of the picker (~33 min; bench/studies/soak.md "Soak"): mixed load (large bodies, idle and abandoned streams, distinct prefixes),
# RSS every 30 s, bench/out/soak/soak.{json,png}; fails if RSS after the soak > 1.2 x after warm-up.
# E.g. `make soak ARGS="--duration 5m"` or ARGS="--picker-env MALLOC_ARENA_MAX=2 --out bench/out/soak-arena2".
soak: install
	$(BIN)/python bench/soak.py $(ARGS)

# Unfinished uploads against --max-buffered-bytes: refusals and the picker's RSS growth (~3 minutes).
upload-memory: install
	$(BIN)/python bench/upload_memory.py $(ARGS)

# Flow control under overload, fast (seconds) then live (~20 min): 5 pickers x 3 phases on 2 sim pods.
overload: install
	$(BIN)/picker bench --scenario overload --mode both --out bench/out/overload $(ARGS)

# Flow control's fairness by requests against by tokens: three light tenants beside a heavy one sending 10x their
# tokens, at 2x the fleet's capacity (fast mode and live sim pods, 3 seeds, ~20 min).
token-fairness: install
	$(BIN)/picker bench --scenario token-fairness --mode both --out bench/out/token-fairness $(ARGS)

# One picker process as the pool grows: decision time, decisions/s, scrape and index cost at 64-4,000 pods, what the
# default profiles' sampling of large pools costs in routing, the round trip through Envoy at 8 and 1,000 pods (~6 min).
scale: install
	$(BIN)/picker bench --scenario scale --out bench/out/scale $(ARGS)

# Prefill/decode disaggregation against aggregated serving at equal pod count, fast mode (~12 minutes).
pd: install
	$(BIN)/picker bench --scenario pd --out bench/out/pd $(ARGS)

# Two base models x 4 sim pods + 2 adapters: round-robin (one pool, per model) vs prefix-hash vs the picker (~12 min).
mixed-models: install
	$(BIN)/picker bench --scenario mixed-models --out bench/out/mixed-models $(ARGS)

# The measurements behind docs/ and bench/README.md, one target per script of bench/: bench/NAME.py runs as
# `make NAME` with hyphens (its docstring says what it measures; ARGS="--help" lists its flags). decision-cost: the
# scheduling core per decision, hashing, index memory (in-process, ~1 min); metrics-cost: recording the Prometheus
# series per request (seconds); exact-index: the approximate index against exact knowledge of every cache (fast
# mode); pick-gaps: requests sent to a pod chosen a moment before, and their cost (fast mode); run-scheduling-sweep:
# scheduling weights beside the defaults and round-robin (fast mode); predicted-priors, predicted-live: the
# predicted-TTFT picker against the defaults and prefix-hash (fast, then live); replicas, replicas-live: picker
# replicas behind one Envoy with and without the shared index (fast, then real processes); shared-index: replication
# lag and per-pick cost on a local Valkey; sim-throughput: requests/s one `picker sim` process sustains (<= ~60 s);
# media-tokens: the picker's image token estimate against Qwen2-VL's processor (transformers, in bench/.venvs/vllm).
BENCH_SCRIPTS := decision-cost metrics-cost exact-index pick-gaps run-scheduling-sweep predicted-priors \
	predicted-live replicas replicas-live shared-index sim-throughput media-tokens
.PHONY: $(BENCH_SCRIPTS)
$(BENCH_SCRIPTS): install
	$(BIN)/python bench/$(subst -,_,$@).py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info picker/api/v1/*_pb2*.py*
