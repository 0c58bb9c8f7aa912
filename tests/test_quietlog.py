"""QuietLog on an injected clock: a burst per window gets out, the rest is counted and reported once."""

from __future__ import annotations

import logging

import pytest

from picker.core.quietlog import QuietLog


def test_a_burst_per_window_then_a_count_of_what_was_held(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    quiet = QuietLog(logging.getLogger("quiet-test"), burst=3, window=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "quiet-test"):
        sent = [quiet.log(logging.WARNING, "bad stream %d", i) for i in range(50)]
        assert sent.count(True) == 3 and len(caplog.records) == 3
        now[0] = 10.0  # the next window
        assert quiet.log(logging.WARNING, "bad stream %d", 50)
    assert caplog.records[-1].getMessage() == "bad stream 50 (47 similar lines held back)"


def test_disabled_levels_cost_nothing_and_spend_no_budget(caplog: pytest.LogCaptureFixture) -> None:
    quiet = QuietLog(logging.getLogger("quiet-test-2"), burst=1, clock=lambda: 0.0)
    with caplog.at_level(logging.WARNING, "quiet-test-2"):
        assert not quiet.log(logging.DEBUG, "detail")
        assert quiet.log(logging.WARNING, "first")
    assert [r.getMessage() for r in caplog.records] == ["first"]
