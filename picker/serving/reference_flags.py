"""The reference endpoint picker's flags (GIE's, now llm-d's router `cmd/epp`), accepted by `picker serve` so that
its Deployment args work unchanged.

Flags that share our name and meaning (`--grpc-port`, `--pool-name`, `--secure-serving`, `--config-text`,
`--drain-timeout`, ...) are simply ours. The rest are declared here: each either maps onto one of our options (log
verbosity and format) or is accepted with one start-up warning saying why it changes nothing here. Every flag takes
Go's spellings, as Go's flag package parses them: `--v=2`, `-v 2`, `--zap-encoder json`, `--health-checking=false`,
and one dash before a long name (`-pool-name=vllm`, `-grpc-port 9002`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

DEST_PREFIX = "reference_"


@dataclass(frozen=True, slots=True)
class ReferenceFlag:
    name: str
    boolean: bool
    ours: str  # what `picker serve` does with it (the README table's text)
    mapped: bool = False  # True: it sets one of our options; False: accepted, warned about, no effect

    @property
    def dest(self) -> str:
        return DEST_PREFIX + self.name.replace("-", "_")


def _ignored(name: str, why: str, *, boolean: bool = False) -> ReferenceFlag:
    return ReferenceFlag(name, boolean, f"accepted, no effect: {why}")


FLAGS: tuple[ReferenceFlag, ...] = (
    ReferenceFlag("v", False, "log verbosity: 4 is `--log-level debug` (a line per decision), 5 and above `trace` "
                  "(library internals too), below 4 `info`", mapped=True),
    ReferenceFlag("zap-log-level", False, "`--log-level` (debug, info, warn, error; a number: <= -1 is debug)",
                  mapped=True),
    ReferenceFlag("zap-encoder", False, "`json`: one JSON object per log line; `console`: our text lines",
                  mapped=True),
    _ignored("zap-devel", "our log lines have one format", boolean=True),
    _ignored("zap-stacktrace-level", "tracebacks are logged with picker faults only"),
    _ignored("zap-time-encoding", "log lines carry local time"),
    _ignored("ha-enable-leader-election", "replicas are active-active (the prefix index is shared through Redis): "
             "there is no leader to elect", boolean=True),
    _ignored("grpc-max-recv-msg-size", "the gRPC limits follow --max-body-bytes (plus 1 MiB)"),
    _ignored("grpc-max-send-msg-size", "the gRPC limits follow --max-body-bytes (plus 1 MiB)"),
    _ignored("disable-endpoint-subset-filter", "Envoy's subset hint is always honoured", boolean=True),
    _ignored("emit-endpoint-scores", "per-endpoint scores are in `picker explain` (the Explain API)", boolean=True),
    _ignored("refresh-prometheus-metrics-interval", "pool gauges refresh every second"),
    _ignored("metrics-staleness-threshold", "staleness is the admission section's `staleAfter`"),
    _ignored("total-queued-requests-metric", "vLLM's metric names are read as vLLM exports them"),
    _ignored("total-running-requests-metric", "vLLM's metric names are read as vLLM exports them"),
    _ignored("kv-cache-usage-percentage-metric", "vLLM's metric names are read as vLLM exports them"),
    _ignored("lora-info-metric", "vLLM's metric names are read as vLLM exports them"),
    _ignored("cache-info-metric", "vLLM's metric names are read as vLLM exports them"),
    _ignored("tracing", "traces go to --otlp-endpoint when it is set", boolean=True),
    _ignored("health-checking", "the gRPC health service always runs", boolean=True),
    _ignored("enable-pprof", "a Go profiler; `python -m cProfile -o FILE -m picker serve ...` profiles ours", boolean=True),
    _ignored("tls-cipher-suites", "grpcio chooses the cipher suites"),
    _ignored("metrics-endpoint-auth", "/metrics is not authenticated (README: why)", boolean=True),
    _ignored("metrics-client-ca-file", "/metrics is served plainly (README: why)"),
    _ignored("metrics-cert-dir", "/metrics is served plainly (README: why)"),
    _ignored("allow-experimental-plugins", "every plugin of ours is available", boolean=True),
)
_BY_NAME = {flag.name: flag for flag in FLAGS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "reference picker flags", "accepted so a Deployment of GIE's / llm-d's endpoint picker runs unchanged "
        "(README: what each does here; default: not given)")
    for flag in FLAGS:
        names = ["-v", "--v"] if flag.name == "v" else [f"--{flag.name}"]
        if flag.boolean:
            group.add_argument(*names, dest=flag.dest, nargs="?", const="true", metavar="BOOL",
                               help=f"{flag.ours} (default: not given)")
        else:
            group.add_argument(*names, dest=flag.dest, metavar="VALUE", help=f"{flag.ours} (default: not given)")


def go_spellings(argv: list[str]) -> list[str]:
    """`-pool-name=x` as `--pool-name=x`: Go's flag package takes one dash or two before any name. Single letters
    (`-v`, `-h`) and negative numbers (`--metrics-port -1`) are left alone; whatever follows `--` too."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        name = arg[1:].split("=", 1)[0]
        single_dash_long = arg.startswith("-") and not arg.startswith("--") and len(name) > 1
        out.append("-" + arg if single_dash_long and name[0].isalpha() else arg)
    return out


def given(args: argparse.Namespace) -> dict[str, str]:
    """The reference flags on the command line: name -> value as given."""
    values = vars(args)
    return {f.name: str(values[f.dest]) for f in FLAGS if values.get(f.dest) is not None}


def notes(flags: Mapping[str, str], index_backend: str = "memory") -> list[str]:
    """One warning per accepted flag that changes nothing here. Leader election's says what the replicas share
    with the index backend they run with: each its own prefix index, unless it is Redis."""
    out = []
    for name, value in flags.items():
        if _BY_NAME[name].mapped:
            continue
        why = _BY_NAME[name].ours
        if name == "ha-enable-leader-election" and index_backend != "redis":
            why = ("accepted, no effect: replicas are active-active with no leader to elect, but with --index-backend "
                   f"{index_backend} each keeps its own prefix index (--index-backend redis --redis-url URL shares "
                   "it)")
        out.append(f"--{name}={value}: {why}")
    return out


def options(flags: Mapping[str, str]) -> dict[str, str]:
    """Our options (flag names) the mapped reference flags set; ValueError naming a bad value."""
    out: dict[str, str] = {}
    if "v" in flags:
        try:
            verbosity = int(flags["v"])
        except ValueError:
            raise ValueError(f"-v {flags['v']!r}: a verbosity is a number (e.g. 2)") from None
        out["log-level"] = "TRACE" if verbosity >= 5 else "DEBUG" if verbosity >= 4 else "INFO"
    if "zap-log-level" in flags:
        out["log-level"] = _zap_level(flags["zap-log-level"])
    if "zap-encoder" in flags:
        encoder = flags["zap-encoder"].lower()
        if encoder not in ("json", "console"):
            raise ValueError(f"--zap-encoder {flags['zap-encoder']!r}: json or console")
        out["log-format"] = "json" if encoder == "json" else "text"
    return out


def _zap_level(text: str) -> str:
    named = {"debug": "DEBUG", "info": "INFO", "warn": "WARNING", "error": "ERROR", "dpanic": "CRITICAL",
             "panic": "CRITICAL", "fatal": "CRITICAL"}
    if text.lower() in named:
        return named[text.lower()]
    try:
        level = int(text)
    except ValueError:
        raise ValueError(f"--zap-log-level {text!r}: debug, info, warn, error or a number") from None
    return "DEBUG" if level <= -1 else "INFO" if level == 0 else "WARNING" if level == 1 else "ERROR"


def readme_table() -> str:
    """The README's table, from the same declarations (a test keeps the README in step)."""
    rows = ["| reference picker flag | what `picker serve` does with it |", "|---|---|"]
    rows += [f"| `--{f.name}` | {f.ours} |" for f in FLAGS]
    return "\n".join(rows)
