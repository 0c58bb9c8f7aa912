"""The backoff helper: growth, cap, jitter, reset, with an injected random source and sleep (nothing waits)."""

from __future__ import annotations

import itertools

import pytest

from picker.core.retry import Backoff


class Sleeps:
    """A stand-in for asyncio.sleep that records what it was asked to wait and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


def test_without_jitter_delays_double_up_to_the_cap() -> None:
    backoff = Backoff(0.05, 2.0, jitter="none")
    assert [backoff.next_delay() for _ in range(8)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert backoff.failures == 8


def test_full_jitter_draws_below_the_growing_ceiling() -> None:
    draws = itertools.cycle([1.0, 0.5, 0.0])
    backoff = Backoff(1.0, 8.0, rand=lambda: next(draws))
    assert [backoff.next_delay() for _ in range(6)] == [1.0, 1.0, 0.0, 8.0, 4.0, 0.0]  # ceilings 1, 2, 4, 8, 8, 8


def test_decorrelated_jitter_grows_from_the_last_delay_and_stays_within_bounds() -> None:
    top = Backoff(1.0, 10.0, jitter="decorrelated", rand=lambda: 1.0)
    assert [top.next_delay() for _ in range(4)] == [3.0, 9.0, 10.0, 10.0]  # 3 x the last, capped
    bottom = Backoff(1.0, 10.0, jitter="decorrelated", rand=lambda: 0.0)
    assert [bottom.next_delay() for _ in range(3)] == [1.0, 1.0, 1.0]  # never below initial
    middle = Backoff(1.0, 10.0, jitter="decorrelated", rand=lambda: 0.5)
    assert [middle.next_delay() for _ in range(3)] == [2.0, 3.5, 5.5]  # between initial and 3 x the last


def test_reset_after_a_success_starts_over() -> None:
    for jitter in ("none", "full", "decorrelated"):
        backoff = Backoff(0.2, 5.0, jitter=jitter, rand=lambda: 1.0)
        first = [backoff.next_delay() for _ in range(3)]
        backoff.reset()
        assert backoff.failures == 0
        assert [backoff.next_delay() for _ in range(3)] == first, jitter


async def test_wait_sleeps_the_delay_and_honours_a_floor() -> None:
    sleeps = Sleeps()
    backoff = Backoff(0.1, 1.0, jitter="none", sleep=sleeps)
    assert await backoff.wait() == 0.1
    assert await backoff.wait(at_least=0.5) == 0.5  # e.g. the server's Retry-After
    await backoff.sleep(0.3)
    assert sleeps.delays == [0.1, 0.5, 0.3]
    assert backoff.next_delay() == 0.4  # the floor did not change the growth


def test_nonsense_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="initial"):
        Backoff(0.0, 1.0)
    with pytest.raises(ValueError, match="initial"):
        Backoff(2.0, 1.0)
    with pytest.raises(ValueError, match="multiplier"):
        Backoff(0.1, 1.0, multiplier=0.5)
