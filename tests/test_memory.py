"""AllocatorTrim: one trim per `after_bytes` of request body, off the event loop, never two at once."""

from __future__ import annotations

import asyncio
import threading

from picker.core.memory import AllocatorTrim


class Trims:
    def __init__(self) -> None:
        self.calls: list[int] = []
        self.threads: set[int] = set()
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, pad: int) -> int:
        self.gate.wait(5)
        self.calls.append(pad)
        self.threads.add(threading.get_ident())
        return 1


async def settle(trim: AllocatorTrim) -> None:
    for _ in range(500):
        if not trim.running:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("trim never finished")


async def test_a_trim_follows_enough_body_bytes_in_a_worker_thread() -> None:
    trims = Trims()
    trim = AllocatorTrim(trims, after_bytes=1000)
    trim.body_bytes(600)
    assert not trim.running and trims.calls == []
    trim.body_bytes(600)
    assert trim.running
    await settle(trim)
    assert trims.calls == [0] and trim.trims == 1
    assert threading.get_ident() not in trims.threads


async def test_bytes_that_pass_during_a_trim_start_no_second_one() -> None:
    trims = Trims()
    trims.gate.clear()
    trim = AllocatorTrim(trims, after_bytes=1000)
    trim.body_bytes(1000)
    for _ in range(5):
        trim.body_bytes(1000)
    trims.gate.set()
    await settle(trim)
    assert trims.calls == [0]
    trim.body_bytes(1000)  # the bytes counted during the trim were enough for the next
    await settle(trim)
    assert trims.calls == [0, 0]


async def test_a_failing_trim_turns_itself_off() -> None:
    def broken(pad: int) -> int:
        raise OSError("no")

    trim = AllocatorTrim(broken, after_bytes=10)
    trim.body_bytes(10)
    await settle(trim)
    trim.body_bytes(10)
    assert not trim.running  # off: nothing scheduled


def test_without_malloc_trim_nothing_is_counted() -> None:
    trim = AllocatorTrim(None, after_bytes=10)
    trim.body_bytes(100)  # no event loop needed: nothing is scheduled
    assert trim.passed == 0 and not trim.running


def test_glibc_provides_it_here() -> None:
    assert AllocatorTrim.from_libc().available  # this machine's Python runs on glibc
