"""The rank pool's bookkeeping (roll_backend/distributed/rank_pool.py) without processes: how many idle processes it
keeps, and which a group takes. The processes themselves (a reused rank is a fresh one) are checked in
tests/strategies/megatron/test_pooled_ranks.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from roll_backend.distributed import rank_pool
from roll_backend.distributed.rank_pool import MAX_IDLE, MIN_AVAILABLE, RankPool


@pytest.fixture
def stopped(monkeypatch) -> list:
    """Every handle answers (released clean, alive when taken), the host has memory to spare; the handles stopped."""
    killed: list = []
    monkeypatch.setattr(rank_pool, "_memory_to_spare", lambda: True)
    monkeypatch.setattr(rank_pool, "_ask", lambda handles, method, timeout_s: ([(h, True) for h in handles], []))
    monkeypatch.setattr(rank_pool, "_kill", killed.append)
    return killed


def handles(name: str, count: int) -> list[str]:
    return [f"{name}{index}" for index in range(count)]


def idle_count(pool: RankPool) -> int:
    return sum(map(len, pool._idle.values()))


class A:
    pass


class B:
    pass


def test_a_host_short_of_memory_keeps_no_more_idle_processes(stopped, monkeypatch):
    pool = RankPool("session")
    pool.give_back(("env",), handles("a", 2), A)
    monkeypatch.setattr(rank_pool, "_memory_to_spare", lambda: False)
    pool.give_back(("env",), handles("b", 2), B)
    assert stopped == handles("b", 2) and idle_count(pool) == 2 and pool.overflow == 2


def test_memory_to_spare_reads_the_hosts_available_share(monkeypatch):
    total = 24 << 30
    for available, spare in ((int(total * MIN_AVAILABLE) - 1, False), (int(total * MIN_AVAILABLE) + 1, True)):
        memory = SimpleNamespace(total=total, available=available)
        monkeypatch.setattr(rank_pool.psutil, "virtual_memory", lambda memory=memory: memory)
        assert rank_pool._memory_to_spare() is spare


def test_the_pool_keeps_up_to_its_cap_and_a_class_takes_its_own_processes_first(stopped):
    pool = RankPool("session")
    pool.give_back(("env",), handles("a", MAX_IDLE - 2), A)
    pool.give_back(("env",), handles("b", 4), B)
    assert stopped == handles("b", 4)[2:]  # (the pool was full after two)
    assert pool.take(("env",), 3, B) == ["b0", "b1", "a0"]  # its own first, then the oldest of another class
    assert pool.take(("other env",), 1, A) == []  # a process keeps the environment it started with
    assert pool.take(("env",), MAX_IDLE, A) == handles("a", MAX_IDLE - 2)[1:]
    assert idle_count(pool) == 0
