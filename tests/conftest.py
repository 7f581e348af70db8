"""Test session set-up: one Ray per session, one actor group per parallel layout per module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from roll_backend.distributed.ray_env import apply_ray_env_defaults

apply_ray_env_defaults()  # before anything starts Ray or gloo

# Test-only worker classes live here; Ray workers import them through PYTHONPATH. (Not tests/ itself:
# tests/roll_backend/ would shadow the real package as a namespace package.)
SUPPORT_DIR = Path(__file__).resolve().parent / "support"


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu(n)` skips a test when fewer than n CUDA GPUs are visible."""
    import torch

    available = torch.cuda.device_count()
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is not None and available < (marker.args[0] if marker.args else 1):
            item.add_marker(
                pytest.mark.skip(reason=f"needs {marker.args[0] if marker.args else 1} GPUs, found {available}")
            )


def pytest_terminal_summary(terminalreporter):
    """How many ranks the rank pool served from idle processes (fresh processes are most of a group's start-up)."""
    from roll_backend.distributed.rank_pool import current_pool

    pool = current_pool()
    if pool is not None:
        terminalreporter.write_line(pool.summary())


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray on loopback for the whole session. Declares more CPUs than the machine has on purpose:
    actor groups take CPU shares, not cores."""
    import ray

    from roll_backend.distributed.rank_pool import enable_rank_pool
    from roll_backend.distributed.ray_env import init_local_ray

    python_path = os.pathsep.join(p for p in (str(SUPPORT_DIR), os.environ.get("PYTHONPATH", "")) if p)
    init_local_ray(num_cpus=32, env_vars={"PYTHONPATH": python_path}, cpu_ranks=True)
    enable_rank_pool()  # a later group of a role takes the processes an earlier one left (rank_pool.py)
    yield ray
    enable_rank_pool(False)
    ray.shutdown()


@pytest.fixture(scope="module")
def make_group(ray_session):
    """Build an actor group once per (worker class, world size, layout, ...) and reuse it in the module."""
    from roll_backend.distributed.layout import ParallelLayout
    from roll_backend.distributed.worker_group import RankResources, WorkerGroup

    groups: dict[tuple, WorkerGroup] = {}

    def make(
        worker_cls,
        world_size: int,
        layout: ParallelLayout = ParallelLayout(),
        role: str = "test",
        resources: RankResources = RankResources(),
        worker_config=None,
        **cluster_kwargs,
    ) -> WorkerGroup:
        key = (worker_cls, role, world_size, layout, resources, repr(worker_config), repr(cluster_kwargs))
        if key not in groups:
            groups[key] = WorkerGroup(
                worker_cls, role, world_size, layout, resources, worker_config=worker_config, **cluster_kwargs
            )
        return groups[key]

    yield make
    for group in groups.values():
        group.shutdown()
