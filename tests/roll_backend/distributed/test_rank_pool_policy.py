"""The rank pool's bookkeeping (roll_backend/distributed/rank_pool.py) without processes: how many idle processes of a
class it keeps and in all, and that groups shutting down at once (a run's roles: RoleGroups.shutdown) keep no more
than one group alone would. The processes themselves (a reused rank is a fresh one) are checked in
tests/strategies/megatron/test_pooled_ranks.py."""

from __future__ import annotations

import threading

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


def test_groups_given_back_at_once_keep_what_one_at_a_time_would(monkeypatch, stopped):
    """Each release waits on its ranks: while one is under way, another of the same class must not take its room."""
    arrived, proceed = threading.Barrier(2), threading.Event()

    def slow_ask(group, method, timeout_s):
        arrived.wait(timeout=10)  # both give-backs have chosen their room before either finishes
        proceed.wait(timeout=10)
        return [(h, True) for h in group], []

    monkeypatch.setattr(rank_pool, "_ask", slow_ask)
    pool = RankPool("session")
    threads = [
        threading.Thread(target=pool.give_back, args=(("A",), handles(name, MAX_IDLE_PER_CLASS))) for name in "xy"
    ]
    for thread in threads:
        thread.start()
    proceed.set()
    for thread in threads:
        thread.join(timeout=20)
    assert len(pool._idle[("A",)]) == MAX_IDLE_PER_CLASS
    assert len(stopped) == MAX_IDLE_PER_CLASS
