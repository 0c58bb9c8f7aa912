"""What a fleet scenario's run says: cold prefills and TTFT in a window, requests sent to a restarted pod for a
prefix only its lost cache held, medians and ranges over repeats, and which routers take part."""

from __future__ import annotations

import math

import pytest

from picker_lab.bench.fleet import medians, misled, noise, prefix_of, recovery, takes_part, window
from picker_lab.bench.results import OK, RunResult
from picker_lab.bench.trace import Trace, TraceRequest


def run(rows: list[tuple[float, int, int, int]]) -> RunResult:
    """(sent, pod, cached tokens, oracle's cached tokens) per request, every one served, TTFT = 10 ms x index."""
    res = RunResult("live", "w", "s", 2, len(rows))
    res.allocate()
    for i, (sent, pod, cached, oracle) in enumerate(rows):
        res.sent[i], res.pod[i], res.cached_tokens[i], res.oracle_cached[i] = sent, pod, cached, oracle
        res.status[i], res.ttft[i], res.prompt_tokens[i] = OK, 0.01 * (i + 1), 100
    return res


def trace(groups: list[int]) -> Trace:
    return Trace("w", 1, 1.0, tuple(TraceRequest(i, float(i), 4, group=g) for i, g in enumerate(groups)))


def test_a_window_counts_cold_prefills_and_its_own_p90() -> None:
    res = run([(0.0, 0, 0, 0), (1.0, 0, 10, 80), (1.5, 1, 80, 80), (2.0, 1, 0, 0), (3.0, 0, 0, 64)])
    got = window(res, 1.0, 3.0)
    assert got["requests"] == 3 and got["cold"] == 1  # 10 of 80 cached is cold; nothing to hit (0 of 0) is not
    assert math.isclose(got["ttft_p90"], 0.038)


def test_misled_counts_only_the_first_return_of_a_prefix_the_pod_lost() -> None:
    # pod 1 served groups 5 and 6 before restarting at t=3; afterwards it gets group 5 twice, group 7 once
    res = run([(0.0, 1, 0, 0), (1.0, 1, 0, 0), (2.0, 0, 0, 0), (4.0, 1, 0, 0), (5.0, 1, 0, 0), (6.0, 1, 0, 0)])
    got = misled(trace([5, 6, 5, 5, 5, 7]), res, pod=1, down=3.0)
    assert got == {"misled": 1, "sent_to_restarted_pod": 3}


def test_a_conversation_is_its_first_turns_prefix() -> None:
    t = Trace("w", 1, 1.0, (TraceRequest(0, 0.0, 4), TraceRequest(1, 1.0, 4, parent=0), TraceRequest(2, 2.0, 4, parent=1)))
    assert prefix_of(t, 2) == prefix_of(t, 0) != prefix_of(trace([3]), 0)


def test_medians_carry_the_range_of_the_repeats() -> None:
    rows = [{"disturbed": {"ttft_p90": v, "disruptions": []}, "extra_cold": c} for v, c in ((3.0, 1), (1.0, 5),
                                                                                          (2.0, 2))]
    table = medians(rows)
    assert table["ttft_p90"] == [2.0, 1.0, 3.0] and table["extra_cold"] == [2.0, 1.0, 5.0]


def test_noise_compares_the_undisturbed_runs_of_two_repeats_window_by_window() -> None:
    def row(*windows: tuple[float, int]) -> dict[str, object]:
        return {"windows": [{"undisturbed": {"ttft_p90": p90, "cold": cold}} for p90, cold in windows]}

    rows = [row((0.10, 2), (0.20, 1)), row((0.11, 2), (0.16, 4))]
    floor = noise(rows)
    # pairs (a, b): ratios 0.909, 1.25 (median 1.08, worst 1.25), colds -3; (b, a): 1.1, 0.8, +3
    assert floor["worst_window_p90_ratio"] == pytest.approx([1.175, 1.1, 1.25])
    assert floor["extra_cold"] == [0.0, -3.0, 3.0]
    assert noise(rows[:1]) == {} and noise([{}, {}]) == {}


def test_noise_reads_the_overlapping_minutes_and_counts_their_span_once() -> None:
    def row(minutes: list[float], span_cold: int) -> dict[str, object]:
        return {"minutes": [{"undisturbed": {"ttft_p90": p90, "cold": 0}} for p90 in minutes],
                "span": {"undisturbed": {"ttft_p90": 0.1, "cold": span_cold}}}

    floor = noise([row([0.10, 0.12], 5), row([0.10, 0.10], 9)])
    # (a, b): ratios 1.0, 1.2 (median 1.1, worst 1.2), span colds -4; (b, a): 1.0, 0.833 (median 0.917, worst 1.0), +4
    assert floor["worst_minute_p90_ratio"] == pytest.approx([1.1, 1.0, 1.2])
    assert floor["minute_p90_ratio"] == pytest.approx([(1.1 + 0.91667) / 2, 0.91667, 1.1], rel=1e-4)
    assert floor["extra_cold_span"] == [0.0, -4.0, 4.0]
    assert "extra_cold" not in floor  # the gap windows' colds only where there are gap windows


def test_only_routers_with_something_to_disrupt_take_part() -> None:
    assert takes_part("valkey-outage", "picker@4") and not takes_part("valkey-outage", "smg-mesh@4")
    assert not takes_part("valkey-outage", "picker") and not takes_part("router-restart", "round-robin")
    assert takes_part("pod-restart", "hash-ring@4") and takes_part("router-restart", "smg@2")


def test_recovery_compares_the_restarted_pods_first_requests_with_fresh_pods() -> None:
    # pod 1 came back at t=3: its first requests after hit 0 then 50 of 100; the pods' first requests of the run
    # (all fresh then) hit 0 and 0 on pod 0, 0 and 100 on pod 1
    res = run([(0.0, 0, 0, 0), (1.0, 1, 0, 0), (1.5, 0, 0, 80), (2.0, 1, 100, 100), (4.0, 1, 0, 0), (5.0, 1, 50, 80)])
    got = recovery(res, pod=1, back=3.0, first=2)
    assert got == {"hit_after_restart": 0.25, "hit_fresh_pods": 0.25}
