"""In-memory prefix index against a naive model: longest-prefix matches, LRU bounds, TTL, purge."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.prefix.hashing import prefix_keys, prefix_seed
from picker.prefix.memory import InMemoryPrefixIndex

ADDRESSES = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
# Three chains sharing their first 20 blocks (a system prompt) then diverging; operations record and probe
# leading parts of them, like requests of different lengths. Chain 3 shares nothing with the others.
SHARED = "shared system prompt" * 8
CHAINS = [prefix_keys(SHARED + f"{i}-variant " * 20, prefix_seed("m"), 8) for i in range(3)]
CHAINS.append(prefix_keys("another tenant " * 20, prefix_seed("m"), 8))


@dataclass
class NaiveIndex:
    """Obviously-correct model: per address a list of keys, most recent last, plus last-touch times."""

    capacity: int
    ttl: float
    caps: dict[str, int] = field(default_factory=dict)
    order: dict[str, list[int]] = field(default_factory=dict)
    times: dict[str, dict[int, float]] = field(default_factory=dict)

    def record(self, keys: list[int], address: str, now: float) -> None:
        order = self.order.setdefault(address, [])
        times = self.times.setdefault(address, {})
        for key in reversed(keys):  # leaf first: the chain head is the most recently used
            if key in order:
                order.remove(key)
            order.append(key)
            times[key] = now
        self._trim(address)

    def _trim(self, address: str) -> None:
        cap = self.caps.get(address, self.capacity)
        order = self.order.get(address, [])
        while len(order) > cap:
            del self.times[address][order.pop(0)]

    def set_capacity(self, address: str, blocks: int) -> None:
        self.caps[address] = blocks
        self._trim(address)

    def remove(self, address: str) -> None:
        self.order.pop(address, None)
        self.times.pop(address, None)
        self.caps.pop(address, None)

    def match(self, keys: list[int], now: float) -> dict[str, int]:
        out = {}
        for address, times in self.times.items():
            n = 0
            while n < len(keys) and keys[n] in times and times[keys[n]] >= now - self.ttl:
                n += 1
            if n:
                out[address] = n
        return out


ops = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.integers(0, 3), st.integers(1, 40), st.sampled_from(ADDRESSES)),
        st.tuples(st.just("remove"), st.sampled_from(ADDRESSES)),
        st.tuples(st.just("capacity"), st.sampled_from(ADDRESSES), st.integers(1, 60)),
        st.tuples(st.just("tick"), st.floats(0.0, 30.0)),
        st.tuples(st.just("expire"),),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(operations=ops, capacity=st.integers(1, 50), probe=st.tuples(st.integers(0, 3), st.integers(1, 40)))
def test_matches_naive_model(operations: list[tuple], capacity: int, probe: tuple[int, int]) -> None:
    ttl = 60.0
    index = InMemoryPrefixIndex(default_capacity=capacity, ttl=ttl)
    model = NaiveIndex(capacity=capacity, ttl=ttl)
    now = 0.0
    for op in operations:
        if op[0] == "record":
            keys = CHAINS[op[1]][: op[2]]
            index.record(keys, op[3], now)
            model.record(keys, op[3], now)
        elif op[0] == "remove":
            index.remove_endpoint(op[1])
            model.remove(op[1])
        elif op[0] == "capacity":
            index.set_capacity(op[1], op[2])
            model.set_capacity(op[1], op[2])
        elif op[0] == "tick":
            now += op[1]
        else:
            index.expire(now)
        for address in ADDRESSES:
            assert index.endpoint_size(address) <= index.capacity(address)
        probe_keys = CHAINS[probe[0]][: probe[1]]
        assert index.match(probe_keys, None, now) == model.match(probe_keys, now)
    assert index.size() <= sum(index.capacity(a) for a in ADDRESSES)


def test_longest_run_from_start() -> None:
    index = InMemoryPrefixIndex()
    keys = CHAINS[0][:30]
    index.record(keys[:12], "a:1", 0.0)
    index.record(keys, "b:1", 0.0)
    index.record(CHAINS[1][:25], "c:1", 0.0)  # shares the first 20 blocks of the system prompt
    assert index.match(keys, None, 1.0) == {"a:1": 12, "b:1": 30, "c:1": 20}
    assert index.match(keys, {"b:1"}, 1.0) == {"b:1": 30}
    assert index.match(CHAINS[3], None, 1.0) == {}
    assert index.match([], None, 1.0) == {}


def test_lru_keeps_recently_used_chain() -> None:
    index = InMemoryPrefixIndex(default_capacity=4)
    index.record([1, 2], "a:1", 0.0)
    index.record([3, 4], "a:1", 1.0)
    index.record([1, 2], "a:1", 2.0)  # refresh 1, 2: now 3, 4 are the oldest
    index.record([5, 6], "a:1", 3.0)
    assert index.match([1, 2], None, 3.0) == {"a:1": 2}
    assert index.match([3, 4], None, 3.0) == {}
    assert index.size() == 4


def test_room_until_the_pods_cache_is_full() -> None:
    index = InMemoryPrefixIndex(default_capacity=4)
    assert index.has_room("a:1")  # never seen: empty
    index.record([1, 2, 3], "a:1", 0.0)
    assert index.has_room("a:1")
    index.record([4], "a:1", 1.0)
    assert not index.has_room("a:1") and index.has_room("b:1")
    index.set_capacity("a:1", 8)
    assert index.has_room("a:1")


def test_ttl_expiry_and_sweep() -> None:
    index = InMemoryPrefixIndex(ttl=10.0)
    index.record([1, 2, 3], "a:1", 0.0)
    index.record([1, 2], "b:1", 5.0)
    assert index.match([1, 2, 3], None, 10.0) == {"a:1": 3, "b:1": 2}
    assert index.match([1, 2, 3], None, 10.5) == {"b:1": 2}
    assert index.expire(10.5) == 3
    assert index.size() == 2
    assert index.match([1, 2, 3], None, 15.5) == {}
    assert index.expire(15.5) == 2 and index.size() == 0


def test_purge_on_removal_and_capacity_shrink() -> None:
    index = InMemoryPrefixIndex()
    index.record([1, 2, 3], "a:1", 0.0)
    index.record([1, 2, 3], "b:1", 0.0)
    index.remove_endpoint("a:1")
    assert index.match([1, 2, 3], None, 0.0) == {"b:1": 3}
    assert index.size() == 3
    index.set_capacity("b:1", 1)  # evicts from the chain's tail: the head block stays matchable
    assert index.size() == 1
    assert index.match([1, 2, 3], None, 0.0) == {"b:1": 1}
    index.remove_endpoint("b:1")
    index.remove_endpoint("never-seen:1")
    assert index.size() == 0
    with pytest.raises(ValueError):
        index.set_capacity("b:1", 0)


def test_late_records_never_make_a_parent_older_than_its_child() -> None:
    """Picks from other replicas arrive a moment late: `never_older` keeps the newer time a block already has."""
    keys = prefix_keys("late " * 200, 1, 64, 256)[:4]
    index = InMemoryPrefixIndex(ttl=60.0)
    index.record(keys[:3], "a", 100.0)
    index.record(keys[:4], "a", 90.0, never_older=True)  # a peer's older pick of a longer chain
    assert index.match(keys, None, 149.0) == {"a": 4}  # cutoff 89: the new leaf (90) still counts
    assert index.match(keys, None, 155.0) == {"a": 3}  # cutoff 95: the leaf expired, its parents (100) did not
    plain = InMemoryPrefixIndex(ttl=60.0)
    plain.record(keys[:3], "a", 100.0)
    plain.record(keys[:4], "a", 90.0)  # without it the parents fall back to 90 and expire with the leaf
    assert plain.match(keys, None, 155.0) == {}
