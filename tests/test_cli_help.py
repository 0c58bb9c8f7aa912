"""What `--help` and a mistyped flag show: help a user can act on, the usage of the command they got wrong."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from picker.cli import SUBCOMMANDS, main
from picker.serving import reference_flags


def help_text(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def option_entries(text: str) -> dict[str, str]:
    """Each option of a --help text (by its first flag) with the rest of its entry, wrapping undone."""
    entries: dict[str, str] = {}
    section = text.split("\noptions:\n", 1)[1]
    flag = ""
    for line in section.splitlines():
        if line.startswith("  -"):
            flag, _, rest = line.strip().partition(" ")
            entries[flag.rstrip(",")] = rest
        elif line.startswith("   ") and flag:
            entries[flag.rstrip(",")] += " " + line.strip()
        else:
            flag = ""
    entries.pop("-h", None)
    return entries


@pytest.mark.parametrize("command,expected", [
    ("envoy-config", {"--mode", "--listen-host", "--listen-port", "--admin-port", "--picker-host", "--picker-port",
                      "--picker-health-port", "--pool", "--fail-closed", "--message-timeout", "--out",
                      "--validate"}),
    ("sim", {"--pods", "--base-port", "--host", "--profile", "--model", "--time-scale", "--seed", "--lora-modules",
             "--kv-events-endpoint", "--kv-events-endpoint-base", "--kv-events-bind-port",
             "--kv-events-replay-port-base", "--num-gpu-blocks", "--scrape-cost", "--eos-mean-tokens"}),
])
def test_every_option_says_its_default(capsys: pytest.CaptureFixture[str], command: str, expected: set[str]) -> None:
    entries = option_entries(help_text(capsys, command))
    assert expected <= set(entries), sorted(entries)
    undocumented = {flag: entry for flag, entry in entries.items() if "default" not in entry}
    assert not undocumented


def test_envoy_config_shows_the_values_it_uses(capsys: pytest.CaptureFixture[str]) -> None:
    entries = option_entries(help_text(capsys, "envoy-config"))
    assert "(default 8080)" in entries["--listen-port"] and "(default 5s)" in entries["--message-timeout"]


def test_top_level_help_talks_about_the_tool(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    description = text.split("\n\n", 2)[1]
    assert "Envoy" in description and "vLLM" in description
    assert "import" not in text and "module" not in text
    for name in SUBCOMMANDS:
        assert name in text


@pytest.mark.parametrize("argv,error", [
    (["serve", "--bogus"], "picker serve: error: unrecognized arguments: --bogus; `picker serve --help` lists the "
     "options"),
    (["envoy-config", "--mode", "buffered", "--bogus", "1"], "picker envoy-config: error: unrecognized arguments: "
     "--bogus 1; `picker envoy-config --help` lists the options"),
    (["sim", "stray"], "picker sim: error: unrecognized arguments: stray; `picker sim --help` lists the options"),
    (["--bogus", "serve"], "picker: error: unrecognized arguments: --bogus; `picker --help` lists the options"),
    (["serve", "--endpionts", "10.0.0.1:8000"], "picker serve: error: unrecognized arguments: --endpionts "
     "10.0.0.1:8000 (did you mean --endpoints?); `picker serve --help` lists the options"),
])
def test_unknown_arguments_are_one_line_with_the_closest_flag(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                              error: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == error + "\n"


def test_go_spellings_of_long_flags_work(capsys: pytest.CaptureFixture[str]) -> None:
    """Go's flag package takes `-pool-name=x` and `-grpc-port 9002`; a wrong one still names the closest flag."""
    from picker.serving import config as cfg

    parser = argparse.ArgumentParser(allow_abbrev=False)
    cfg.add_arguments(parser)
    args = parser.parse_args(reference_flags.go_spellings(["-pool-name=vllm", "-grpc-port", "9100", "-v", "4",
                                                           "-metrics-port", "-1"]))
    assert (args.pool_name, args.grpc_port, args.metrics_port) == ("vllm", 9100, -1)
    with pytest.raises(SystemExit):
        main(["serve", "-pool-nam=vllm"])
    assert "(did you mean --pool-name?)" in capsys.readouterr().err


def test_unknown_flag_as_typed() -> None:
    result = subprocess.run([sys.executable, "-m", "picker", "serve", "--bogus"], capture_output=True, text=True,
                            timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 2
    assert result.stderr == ("picker serve: error: unrecognized arguments: --bogus; `picker serve --help` lists the "
                             "options\n")
