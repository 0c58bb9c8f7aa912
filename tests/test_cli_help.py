"""What `--help` and a mistyped flag show: help a user can act on, the usage of the command they got wrong."""

from __future__ import annotations

import subprocess
import sys

import pytest

from picker.cli import SUBCOMMANDS, main


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


@pytest.mark.parametrize("argv,usage,error", [
    (["serve", "--bogus"], "usage: picker serve ", "picker serve: error: unrecognized arguments: --bogus"),
    (["envoy-config", "--mode", "buffered", "--bogus", "1"], "usage: picker envoy-config ",
     "picker envoy-config: error: unrecognized arguments: --bogus 1"),
    (["sim", "stray"], "usage: picker sim ", "picker sim: error: unrecognized arguments: stray"),
    (["--bogus", "serve"], "usage: picker [-h] COMMAND", "picker: error: unrecognized arguments: --bogus"),
])
def test_unknown_arguments_show_the_usage_of_their_command(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                          usage: str, error: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and err.rstrip().endswith("\n" + error), err


def test_unknown_flag_as_typed() -> None:
    result = subprocess.run([sys.executable, "-m", "picker", "serve", "--bogus"], capture_output=True, text=True,
                            timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: picker serve ")
    assert result.stderr.splitlines()[-1] == "picker serve: error: unrecognized arguments: --bogus"
