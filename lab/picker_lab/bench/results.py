"""What one (workload, strategy) run measured, in a form both modes fill and the report reads."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OK, SHED, FAILED = 0, 1, 2


@dataclass
class RunResult:
    """Per-request columns (index = trace index) plus per-pod totals and a load time series.

    Times are seconds from the start of the run (model seconds in fast mode, wall seconds in live mode).
    `ttft` is client-side: first streamed token minus send time.
    """

    mode: str
    workload: str
    strategy: str
    pods: int
    n: int
    sent: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)  # NaN when no token came back
    e2e: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)  # mean inter-token latency of the request (NaN: < 2 tokens)
    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    oracle_cached: list[int] = field(default_factory=list)  # tokens the infinite-cache oracle would have hit
    output_tokens: list[int] = field(default_factory=list)
    pod: list[int] = field(default_factory=list)  # -1 when not routed
    status: list[int] = field(default_factory=list)  # OK, SHED, FAILED
    # per pod, from the engines' own counters
    pod_served: list[int] = field(default_factory=list)
    pod_busy_s: list[float] = field(default_factory=list)
    prefix_queries: int = 0  # vllm:prefix_cache_queries (tokens, every lookup)
    prefix_hits: int = 0  # vllm:prefix_cache_hits
    prompt_tokens_total: int = 0  # vllm:prompt_tokens
    prompt_tokens_cached: int = 0  # vllm:prompt_tokens_cached (hit at first admission)
    generation_tokens: int = 0
    preemptions: int = 0
    oracle_queries: int = 0  # prompt tokens seen by the infinite-cache oracle
    oracle_hits: int = 0
    load_times: list[float] = field(default_factory=list)
    load_per_pod: list[list[int]] = field(default_factory=list)  # [sample][pod] running + waiting
    duration_s: float = 0.0  # first send to last finish
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    bypassed: list[int] = field(default_factory=list)  # requests sent around the picker (fast mode's bypass)

    def allocate(self) -> None:
        """Size the per-request columns for `n` requests."""
        nan = float("nan")
        n = self.n
        self.sent = [nan] * n
        self.ttft = [nan] * n
        self.e2e = [nan] * n
        self.itl = [nan] * n
        self.prompt_tokens = [0] * n
        self.cached_tokens = [0] * n
        self.oracle_cached = [0] * n
        self.output_tokens = [0] * n
        self.pod = [-1] * n
        self.status = [FAILED] * n


def stored_json(directory: Path, name: str) -> Path:
    """`name` in `directory`, or its gzip-compressed copy `name.gz` when only that exists: results kept in git
    store their per-request rows compressed (bench/results), fresh ones in bench/out are plain."""
    plain = directory / name
    packed = directory / (name + ".gz")
    return packed if packed.is_file() and not plain.is_file() else plain


def read_json(path: Path) -> Any:
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def write_json_text(path: Path, text: str) -> None:
    """`text` to `path`, compressed (reproducibly: no name or time in the header) when it ends in .gz."""
    data = text.encode()
    path.write_bytes(gzip.compress(data, compresslevel=9, mtime=0) if path.suffix == ".gz" else data)
