"""Each plugin default is written once: in its constructor. Parameter sections take theirs from it (`default_of`),
and the default scheduling config lists a parameter only where it sets it otherwise."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import pytest

from picker.scheduling.config import DEFAULT_CONFIG, PLUGIN_FACTORIES
from picker.scheduling.plugins import NoParams

# Parameter sections whose fields are no constructor argument of one plugin (a factory maps them), and why.
MAPPED_BY_THEIR_FACTORY = {
    "saturation-filter": "unset thresholds are the admission section's",
    # the reference's P/D keys: two formats (nested or flat, unset = not given) and keys only accepted
    "disagg-profile-handler": "nested or flat keys, unset meaning not given",
    "pd-profile-handler": "keys the reference declares but does not read (unset), and primaryPort (0 only)",
    "disagg-headers-handler": "encodeProfile is only named", "prefill-header-handler": "encodeProfile is only named",
    "mm-embeddings-cache-scorer": "producerName is only named",
}


def _literal_defaults(params: type[Any]) -> list[str]:
    """Fields of a parameter section whose default is written as a literal in its class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(params)))
    literal = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            value = node.value
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "Field" \
                    and value.args:
                value = value.args[0]
            if isinstance(value, ast.Constant | ast.UnaryOp):
                literal.append(node.target.id)
    return literal


@pytest.mark.parametrize("plugin_type", sorted(PLUGIN_FACTORIES))
def test_parameter_sections_take_their_defaults_from_the_constructor(plugin_type: str) -> None:
    params = PLUGIN_FACTORIES[plugin_type].params
    if params is NoParams or plugin_type in MAPPED_BY_THEIR_FACTORY:
        return
    assert _literal_defaults(params) == [], f"{params.__name__}: write the default in the plugin's constructor " \
                                            "and declare it with default_of"


def test_the_default_config_lists_only_parameters_it_sets_otherwise() -> None:
    for spec in DEFAULT_CONFIG["plugins"]:
        params = PLUGIN_FACTORIES[spec["type"]].params
        defaults = params().model_dump(by_alias=True)
        same = {k: v for k, v in spec.get("parameters", {}).items() if defaults.get(k) == v}
        assert same == {}, f"{spec['name']}: {same} repeat the defaults"


def test_serve_flags_take_their_defaults_from_the_config_model() -> None:
    """`picker serve --help` states each default from ServeConfig, never as a literal of its own."""
    import argparse
    import re

    from picker.serving import config

    source = inspect.getsource(config.add_arguments)
    literal = re.findall(r"default:? (?:[0-9][0-9a-zA-Z.]*|true|false|http|text|INFO|/metrics)\b", source)
    assert literal == [], f"write {{default}} in the help instead of {literal}"
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    helps = {a.dest: a.help or "" for a in parser._actions}
    assert "(default 9002)" in helps["grpc_port"] and "(default 16Mi)" in helps["max_body_bytes"]
    assert "(default 100ms)" in helps["metrics_fast_interval"] and "default 5s" in helps["shutdown_delay"]
    assert "(default true)" in helps["metrics_only_read_series"]
