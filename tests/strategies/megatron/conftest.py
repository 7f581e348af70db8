"""Groups shared by the Megatron layout tests of this package: one ReconfigurableActor group per layout, started
together once for the consecutive tests that use them (a model is loaded into a running group with `init_model_with`, in
milliseconds for a tiny one)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

from roll_backend.distributed.layout import ParallelLayout

# The reference layout first; every other layout's numbers are compared with its.
SHARED_LAYOUTS = {
    "tp1": ParallelLayout(),
    "tp2": ParallelLayout(tp=2),
    "pp2": ParallelLayout(pp=2),
    "tp2pp2": ParallelLayout(tp=2, pp=2),
    "cp2": ParallelLayout(cp=2),
    "pp2vpp2": ParallelLayout(pp=2, vpp=2),
    "ep2": ParallelLayout(ep=2),  # two data-parallel ranks; MoE models split their experts over them
}
DATA_PARALLEL = {"ep2": 2}  # data-parallel ranks where not 1


class LayoutPool(Mapping):
    """{layout name: a started ReconfigurableActor group} for SHARED_LAYOUTS, all started together on first use
    (again after `shut_down`, so a test that needs them later gets new groups)."""

    layouts = SHARED_LAYOUTS

    def __init__(self):
        self._groups: dict = {}

    def _ensure_started(self) -> dict:
        if not self._groups:
            from reconfigurable_workers import ReconfigurableActor

            from roll_backend.distributed.worker_group import WorkerGroup, start_together
            from roll_backend.strategies.megatron.config import MegatronTrainConfig
            from roll_backend.workers.actor import ActorConfig

            placeholder = ActorConfig(strategy=MegatronTrainConfig(model_path="unused"))
            try:
                for name, layout in SHARED_LAYOUTS.items():
                    self._groups[name] = WorkerGroup(
                        ReconfigurableActor,
                        f"layout_{name}",
                        layout.model_parallel_size * DATA_PARALLEL.get(name, 1),
                        layout,
                        worker_config=placeholder,
                        wait=False,
                    )
                start_together(list(self._groups.values()))
            except BaseException:
                self.shut_down()
                raise
        return self._groups

    def __getitem__(self, name: str):
        return self._ensure_started()[name]

    def __iter__(self):
        return iter(SHARED_LAYOUTS)

    def __len__(self) -> int:
        return len(SHARED_LAYOUTS)

    @property
    def running(self) -> bool:
        return bool(self._groups)

    def shut_down(self) -> None:
        for group in self._groups.values():
            group.shutdown()
        self._groups.clear()


_POOL = LayoutPool()
HERE = Path(__file__).parent


_last_user: list = []  # the last collected test that uses the shared groups


@pytest.fixture(scope="session")
def layout_actors(ray_session) -> LayoutPool:
    """The shared groups (see LayoutPool); stopped after the last test that uses them, so their ranks hold no memory
    through the rest of the session."""
    yield _POOL
    _POOL.shut_down()


def pytest_collection_modifyitems(config, items):
    """The modules of this folder that start only groups of their own run after the last test of the shared groups
    (moved whole, so their module fixtures stay together): their ranks then come from the rank pool, which is empty
    while the shared groups hold its processes."""
    users = [item for item in items if "layout_actors" in getattr(item, "fixturenames", ())]
    if users:
        first, last = items.index(users[0]), items.index(users[-1])
        user_paths = {item.path for item in users}
        span = items[first : last + 1]
        moved = [item for item in span if item.path.parent == HERE and item.path not in user_paths]
        moved_ids = {id(item) for item in moved}
        items[first : last + 1] = [item for item in span if id(item) not in moved_ids] + moved
    _last_user[:] = users[-1:]


def pytest_runtest_teardown(item, nextitem):
    if _POOL.running and (nextitem is None or item in _last_user):
        _POOL.shut_down()
