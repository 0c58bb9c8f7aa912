"""The token-fairness scenario's fast twin: flow control's fairness by tokens against by requests, a heavy tenant
sending ten times the tokens of three light ones at twice the fleet's capacity."""

from __future__ import annotations

from pathlib import Path

from picker_lab.bench.token_fairness import (
    HEAVY_TENANT,
    LIGHT_TENANTS,
    TokenFairnessSpec,
    arrivals,
    run_token_fairness,
)


def test_arrivals_are_the_same_with_and_without_the_heavy_tenant() -> None:
    """The unloaded phase replays the loaded phase's light requests, not a fresh draw."""
    drawn = list(arrivals(20.0, 10.0, seed=4))
    assert {tenant for _, tenant, _ in drawn} == {*LIGHT_TENANTS, HEAVY_TENANT}
    again = [a for a in arrivals(20.0, 10.0, seed=4) if a[1] != HEAVY_TENANT]
    assert again == [a for a in drawn if a[1] != HEAVY_TENANT]


def test_by_tokens_the_light_tenants_are_served_and_faster_than_by_turns(tmp_path: Path) -> None:
    report = run_token_fairness(TokenFairnessSpec(phase_s=12.0, repeats=1), ("fast",), tmp_path)
    run = report["fast"][0]
    by_turns, by_tokens = run["requests"], run["tokens"]
    # by turns the light tenants are backlogged (each offered 2/13 of the pods, given 1/13): some time out
    assert by_turns["loaded"]["light"]["served_share"] < 0.9
    assert by_tokens["loaded"]["light"]["served_share"] == 1.0
    assert by_tokens["light_p90_ratio"] < by_turns["light_p90_ratio"] / 2
    assert "| tokens |" in (tmp_path / "token-fairness.md").read_text()
