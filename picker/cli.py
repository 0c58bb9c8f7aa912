"""`picker` command line: each subcommand lives in its own module and is imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with add_arguments(parser) and run(args) -> int, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("picker.server", "run the ext_proc endpoint picker (gRPC), health service and metrics"),
    "demo": ("picker.demo", "start Envoy, a simulated vLLM fleet and the picker; send sample requests"),
    "envoy-config": ("picker.envoyconfig", "write a checked Envoy config that uses the picker"),
    "explain": ("picker.explain", "ask a running picker why a request would go where it goes"),
    "sim": ("picker.sim.cli", "run simulated vLLM servers (OpenAI API, /metrics, KV events)"),
    "bench": ("picker.bench.cli", "compare routing strategies on the same trace and fleet"),
}

# `pip install picker` is the serving picker; these subcommands need an extra (pyproject.toml's
# optional-dependencies): subcommand -> (extra, modules the extra installs). The demo runs `picker sim`.
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sim": ("sim", ("zmq",)),
    "demo": ("sim", ("zmq",)),
    "bench": ("bench", ("zmq", "matplotlib")),
}


def missing_extra(command: str | None) -> str | None:
    """The one-line reason `command` cannot run when its extra is not installed, else None."""
    extra, modules = EXTRAS.get(command or "", ("", ()))
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if not missing:
        return None
    return (f"picker {command}: needs the '{extra}' extra (missing: {', '.join(missing)}); "
            f"install it with: pip install 'picker[{extra}]'")


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    # No abbreviations: `--endpoints-fil` must be an error, not a silent `--endpoints-file`.
    parser = argparse.ArgumentParser(prog="picker", description=__doc__, allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = args_list[0] if args_list else None
    reason = missing_extra(chosen)
    if reason:
        print(reason, file=sys.stderr)
        return 1
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        sub_parser.set_defaults(_module=module_name)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(sub_parser)
    args = parser.parse_args(args_list)
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
