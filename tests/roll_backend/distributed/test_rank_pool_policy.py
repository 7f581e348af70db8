"""The rank pool's bookkeeping (roll_backend/distributed/rank_pool.py) without processes: how many idle processes of a
class it keeps, and which it stops to stay within its total (the classes given back longest ago). The processes
themselves (a reused rank is a fresh one) are checked in tests/strategies/megatron/test_pooled_ranks.py."""

from __future__ import annotations

import pytest

from roll_backend.distributed import rank_pool
from roll_backend.distributed.rank_pool import MAX_IDLE, MAX_IDLE_PER_CLASS, RankPool


@pytest.fixture
def stopped(monkeypatch) -> list:
    """Every handle answers (released clean, alive when taken); the handles stopped, in order."""
    killed: list = []
    monkeypatch.setattr(rank_pool, "_ask", lambda handles, method, timeout_s: ([(h, True) for h in handles], []))
    monkeypatch.setattr(rank_pool, "_kill", killed.append)
    return killed


def handles(name: str, count: int) -> list[str]:
    return [f"{name}{index}" for index in range(count)]


def test_a_class_keeps_up_to_its_cap_and_the_total_evicts_the_least_recently_given_back(stopped):
    pool = RankPool("session")
    pool.give_back(("A",), handles("a", MAX_IDLE_PER_CLASS + 2))
    assert stopped == handles("a", MAX_IDLE_PER_CLASS + 2)[MAX_IDLE_PER_CLASS:]  # past the class's cap
    stopped.clear()
    classes = [("A",)] + [(name,) for name in "BCDEFG"]
    for key in classes[1:]:
        pool.give_back(key, handles(key[0].lower(), MAX_IDLE_PER_CLASS))
        idle = {k: len(v) for k, v in pool._idle.items() if v}
        assert sum(idle.values()) <= MAX_IDLE
        assert idle[key] == MAX_IDLE_PER_CLASS  # the class just given back is kept whole
    # the total was kept by stopping the oldest classes' processes first: A's, then B's, ...
    first_stopped = [h[0] for h in stopped]
    assert first_stopped == sorted(first_stopped)
    assert pool.take(classes[-1], 2) == handles("g", 2)
    assert pool.take(("A",), 1) == []  # long gone
    pool.give_back(("A",), ["a9"])  # given back most recently now: another class makes room if needed
    assert pool.take(("A",), 1) == ["a9"]
