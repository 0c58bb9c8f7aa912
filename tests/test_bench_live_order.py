"""Live mode runs its routers in the order asked, peers included, so a repeated bench can reverse it."""

from __future__ import annotations

import argparse

from picker_lab.bench import cli
from picker_lab.bench.live import LiveSpec


def spec_for(*flags: str) -> LiveSpec:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return LiveSpec.from_args(parser.parse_args(list(flags)))


def test_peers_run_where_they_are_asked() -> None:
    spec = spec_for("--strategies", "vllm-router,picker,sglang-router,round-robin")
    assert spec.order == ("vllm-router", "picker", "sglang-router", "round-robin")
    assert spec.strategies == ("picker", "round-robin")
    assert spec.peers == ("vllm-router", "sglang-router")


def test_peers_named_only_by_flag_run_after_the_strategies() -> None:
    spec = spec_for("--strategies", "picker,round-robin", "--peers", "sglang-router")
    assert spec.order == ("picker", "round-robin", "sglang-router")


def test_peers_dropped_by_flag_do_not_run() -> None:
    spec = spec_for("--strategies", "sglang-router,picker", "--peers", "none")
    assert spec.order == ("picker",)
