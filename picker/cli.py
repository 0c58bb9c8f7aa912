"""`picker` command line: each subcommand lives in its own module and is imported only when used."""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys

from picker.core.children import ProcessExited
from picker.core.distribution import DIST_NAME, lab_install_hint, version_line
from picker.serving import reference_flags

# subcommand -> (module with add_arguments(parser) and run(args) -> int, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("picker.serving.server", "run the ext_proc endpoint picker (gRPC), health service and metrics"),
    "demo": ("picker_lab.demo", "start Envoy, a simulated vLLM fleet and the picker; send sample requests"),
    "envoy-config": ("picker.serving.envoyconfig", "write a checked Envoy config that uses the picker"),
    "explain": ("picker.tools.explain", "ask a running picker why a request would go where it goes"),
    "doctor": ("picker.tools.doctor", "ask Envoy whether requests reach the picker, and why not when they fail open"),
    "pd-sidecar": ("picker.serving.pd_sidecar", "run beside a decode pod: prefill on the pod the picker names, "
                   "then decode here (P/D disaggregation)"),
    "sim": ("picker_lab.sim.cli", "run simulated vLLM servers (OpenAI API, /metrics, KV events)"),
    "bench": ("picker_lab.bench.cli", "compare routing strategies on the same trace and fleet"),
}

# `pip install llm-picker` is the serving picker; these subcommands are the lab's (lab/, the llm-picker-lab
# distribution, installed from a checkout), some with an extra of its own: subcommand -> (extra, modules needed).
LAB: dict[str, tuple[str, tuple[str, ...]]] = {
    "sim": ("", ("picker_lab", "zmq")),
    "demo": ("", ("picker_lab", "zmq")),
    "bench": ("bench", ("picker_lab", "zmq", "matplotlib")),
}


def missing_lab(command: str | None) -> str | None:
    """The one-line reason `command` cannot run when the lab (or its extra) is not installed, else None."""
    extra, modules = LAB.get(command or "", ("", ()))
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if not missing:
        return None
    return (f"picker {command}: part of the lab, not of the {DIST_NAME} wheel (missing: {', '.join(missing)}); "
            f"from a checkout of the repository: {lab_install_hint(extra)}")


DESCRIPTION = (
    "An endpoint picker for LLM inference behind Envoy. Envoy streams each request to `picker serve` over "
    "ext_proc; the picker routes it to the vLLM pod that already caches the prompt's prefix and has room, or "
    "sheds it. The other commands write the Envoy config, explain a routing decision, and run a simulated "
    "vLLM fleet, a demo and a routing benchmark."
)


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    # No abbreviations: `--endpoints-fil` must be an error, not a silent `--endpoints-file`.
    parser = argparse.ArgumentParser(prog="picker", description=DESCRIPTION, allow_abbrev=False,
                                     epilog="`picker COMMAND --help` lists a command's options.")
    parser.add_argument("--version", action=_Version, help="the distribution's version (and the commit it was built "
                        "from, when known), then exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = args_list[0] if args_list else None
    reason = missing_lab(chosen)
    if reason:
        print(reason, file=sys.stderr)
        return 1
    subparsers: dict[str, argparse.ArgumentParser] = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        sub_parser.set_defaults(_module=module_name)
        subparsers[name] = sub_parser
        if name == chosen:
            importlib.import_module(module_name).add_arguments(sub_parser)
    # A subparser hands unknown arguments back to the top level, whose error would show `picker`'s usage:
    # the user needs the usage of the command they got wrong.
    if chosen == "serve":
        args_list = [chosen, *reference_flags.go_spellings(args_list[1:])]
    args, unknown = parser.parse_known_args(args_list)
    if unknown:
        owner = subparsers[args.command] if chosen == args.command else parser
        owner.exit(2, f"{owner.prog}: error: unrecognized arguments: {' '.join(unknown)}{_suggest(owner, unknown)}\n")
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except ProcessExited as exited:  # a child of a command that starts some (the benchmark's, say) died
        print(f"picker {args.command}: {exited.describe()}", file=sys.stderr)
        return 1


class _Version(argparse.Action):
    """`picker --version`: the version line is worked out (git, for a checkout) only when asked for."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:  # noqa: A002
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(version_line())
        parser.exit()


def _suggest(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """One line instead of the whole usage: the closest known flag to each unknown one, and where the rest is."""
    known = sorted(set(re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", parser.format_usage())))
    close = [match for arg in unknown if arg.startswith("-")
             for match in difflib.get_close_matches(arg.split("=", 1)[0], known, n=1, cutoff=0.75)]
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return f"{hint}; `{parser.prog} --help` lists the options"


if __name__ == "__main__":
    sys.exit(main())
