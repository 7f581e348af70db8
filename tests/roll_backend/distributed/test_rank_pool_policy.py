"""The rank pool's bookkeeping (roll_backend/distributed/rank_pool.py) without processes: how many idle processes of a
class it keeps and in all. The processes themselves (a reused rank is a fresh one) are checked in
tests/strategies/megatron/test_pooled_ranks.py."""

from __future__ import annotations

import pytest

from roll_backend.distributed import rank_pool
from roll_backend.distributed.rank_pool import MAX_IDLE, MAX_IDLE_PER_CLASS, RankPool


@pytest.fixture
def stopped(monkeypatch) -> list:
    """Every handle answers (released clean, alive when taken); the handles stopped."""
    killed: list = []
    monkeypatch.setattr(rank_pool, "_ask", lambda handles, method, timeout_s: ([(h, True) for h in handles], []))
    monkeypatch.setattr(rank_pool, "_kill", killed.append)
    return killed


def handles(name: str, count: int) -> list[str]:
    return [f"{name}{index}" for index in range(count)]


def idle_count(pool: RankPool) -> int:
    return sum(map(len, pool._idle.values()))


def test_a_class_keeps_up_to_its_cap_and_the_pool_up_to_its_total(stopped):
    pool = RankPool("session")
    pool.give_back(("A",), handles("a", MAX_IDLE_PER_CLASS + 2))
    assert stopped == handles("a", MAX_IDLE_PER_CLASS + 2)[MAX_IDLE_PER_CLASS:]
    classes = [(chr(ord("B") + index),) for index in range(MAX_IDLE)]
    for key in classes:
        pool.give_back(key, handles(key[0].lower(), MAX_IDLE_PER_CLASS))
        assert idle_count(pool) <= MAX_IDLE
    assert idle_count(pool) == MAX_IDLE
    assert pool.take(("A",), 3) == handles("a", MAX_IDLE_PER_CLASS)[:3]  # the first kept stay
    assert pool.take(classes[-1], 1) == []  # the last found the pool full
