"""MovingDeadline: the servicer's per-stream timer. It must fire at the deadline as it last stood (moved later or
earlier), turn only its own cancellation into TimeoutError, and leave no timer behind."""

from __future__ import annotations

import asyncio

import pytest

from picker.extproc.deadline import MovingDeadline


async def _wait_forever() -> None:
    await asyncio.Event().wait()


async def test_fires_at_the_deadline_as_last_moved_later() -> None:
    loop = asyncio.get_running_loop()
    began = loop.time()
    step = asyncio.Event()
    loop.call_later(0.05, step.set)
    with pytest.raises(TimeoutError), MovingDeadline(loop, began + 0.1) as deadline:
        await step.wait()
        deadline.move(loop.time() + 0.2)  # the timer armed for +0.1 must not end it
        await _wait_forever()
    assert loop.time() - began >= 0.25


async def test_a_deadline_moved_earlier_fires_early() -> None:
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(TimeoutError), MovingDeadline(loop, began + 60) as deadline:
        deadline.move(began + 0.05)
        await _wait_forever()
    assert 0.05 <= loop.time() - began < 30


async def test_a_block_that_ends_in_time_leaves_no_timer() -> None:
    loop = asyncio.get_running_loop()
    with MovingDeadline(loop, loop.time() + 0.02) as deadline:
        deadline.move(loop.time() + 0.01)  # re-armed once: neither timer may outlive the block
    await asyncio.sleep(0.05)  # a timer left behind would cancel this task here


async def test_someone_elses_cancellation_stays_a_cancellation() -> None:
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()

    async def stream() -> None:
        with MovingDeadline(loop, loop.time() + 60):
            entered.set()
            await _wait_forever()

    task = asyncio.create_task(stream())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_outside_a_task_is_an_error() -> None:
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[BaseException | None] = loop.create_future()

    def enter() -> None:  # a plain callback: no task is running
        try:
            with MovingDeadline(loop, loop.time() + 1):
                pass
        except RuntimeError as exc:
            outcome.set_result(exc)
        else:
            outcome.set_result(None)

    loop.call_soon(enter)
    assert "inside a task" in str(await outcome)
