"""The rank pool (roll_backend/distributed/rank_pool.py): a later group of a role takes the processes an earlier one
left, and a rank in a reused process is the rank a fresh process would be. The same model at the same layout gives the
same log-probs bit for bit in the processes a smaller group of another model used in between (a stale model,
process group or parallel state would change them), with one orphan watchdog however many ranks it served; a group
that broke leaves no process behind for the next group; a reward rank runs user code in a child and is reused."""

from __future__ import annotations

import os
import signal

import psutil
import pytest
import ray
import torch
from megatron_batches import hf_response_log_probs, make_rl_batch_tensors, max_masked_diff
from process_checks import describe, wait_until_gone

from roll_backend import keys
from roll_backend.distributed import rank_pool
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.distributed.worker import Worker
from roll_backend.distributed.worker_group import GroupBrokenError, RankDiedError, WorkerGroup
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import MegatronInferConfig
from roll_backend.workers.reference import ReferenceConfig, ReferenceWorker
from roll_backend.workers.reward import RewardWorker, RewardWorkerConfig

TOL = 2e-5


@pytest.fixture
def empty_pool(ray_session):
    """The pool on and empty: the next groups start their own processes and leave them to the pool."""
    rank_pool.enable_rank_pool(False)
    rank_pool.enable_rank_pool()
    yield
    rank_pool.enable_rank_pool(False)  # (this module's processes are of no use to another)
    rank_pool.enable_rank_pool()


def _model(tmp_path_factory, layers: int, heads: int) -> str:
    spec = TinyModelSpec(
        hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2
    )
    return str(build_tiny_model(tmp_path_factory.mktemp(f"pooled{layers}"), spec))


def _reference(model_path: str, world_size: int, layout: ParallelLayout) -> WorkerGroup:
    config = ReferenceConfig(strategy=MegatronInferConfig(model_path=model_path, micro_batch_size=2))
    group = WorkerGroup(ReferenceWorker, "reference", world_size, layout, worker_config=config)
    group.call(ReferenceWorker.init_model)
    return group


def _log_probs(group: WorkerGroup, tensors) -> torch.Tensor:
    return group.call(ReferenceWorker.compute_log_probs, DataProto.from_dict(tensors=tensors)).batch[keys.LOG_PROBS]


def _watchdogs(pid: int) -> list[psutil.Process]:
    """The orphan watchdogs (distributed/orphans.py) a rank process started."""
    return [child for child in psutil.Process(pid).children() if "POLL_S" in " ".join(child.cmdline())]


def test_a_reused_process_gives_a_fresh_ranks_numbers_and_a_broken_group_leaves_none(empty_pool, tmp_path_factory):
    first_model, other_model = _model(tmp_path_factory, 2, 4), _model(tmp_path_factory, 3, 2)
    tensors = make_rl_batch_tensors(vocab_size=320, num_rows=5, seed=3)
    mask = tensors[keys.RESPONSE_MASK]

    fresh = _reference(first_model, 2, ParallelLayout(tp=2))
    fresh_pids = fresh.call(Worker.pid)
    fresh_log_probs = _log_probs(fresh, tensors)
    fresh.shutdown()

    # Another model at TP1 in one of those processes: its own numbers, not the first model's.
    other = _reference(other_model, 1, ParallelLayout())
    (other_pid,) = other.call(Worker.pid)
    assert other_pid in fresh_pids
    expected, _ = hf_response_log_probs(other_model, tensors)
    assert max_masked_diff(_log_probs(other, tensors), expected, mask) < TOL
    other.shutdown()

    again = _reference(first_model, 2, ParallelLayout(tp=2))
    assert sorted(again.call(Worker.pid)) == sorted(fresh_pids)
    assert [len(_watchdogs(pid)) for pid in fresh_pids] == [1, 1]  # one per process, however many ranks it served
    assert [coords.tp for coords in again.coords] == [0, 1]
    assert torch.equal(_log_probs(again, tensors), fresh_log_probs)

    killed_pid = again.call(Worker.pid)[1]
    ray.kill(again.workers[1])
    assert describe(wait_until_gone([killed_pid], within_s=30)) == []  # (ray.kill returns before the process ends)
    with pytest.raises((RankDiedError, GroupBrokenError)):
        again.call(Worker.pid)
    again.shutdown()
    after_break = _reference(other_model, 1, ParallelLayout())
    assert not set(after_break.call(Worker.pid)) & set(fresh_pids)  # the broken group's processes were stopped
    after_break.shutdown()


def test_a_reward_rank_runs_user_code_in_a_child_and_is_reused(empty_pool, tmp_path):
    from roll_backend.rewards.user_functions import RewardFunctionSpec

    batch = DataProto.from_dict(
        tensors={keys.RESPONSE_MASK: torch.ones(2, 3, dtype=torch.long)},
        non_tensors={keys.RESPONSE_TEXT: ["7", "8"], keys.ANSWER: ["7", "7"]},
    )
    plain = WorkerGroup(RewardWorker, "reward", 1, worker_config=RewardWorkerConfig(rewards={"exact_match": 1.0}))
    (plain_pid,) = plain.call(Worker.pid)
    plain.shutdown()

    path = tmp_path / "user_rewards.py"
    path.write_text(
        "import os\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 0.5, 'pid': float(os.getpid())}\n"
    )
    config = RewardWorkerConfig(rewards={}, functions=(RewardFunctionSpec(path=str(path)),))
    with_user_code = WorkerGroup(RewardWorker, "reward", 1, worker_config=config)
    assert with_user_code.call(Worker.pid) == [plain_pid]  # a rank that ran no user code is reused
    scored = with_user_code.call(RewardWorker.compute_rewards, batch)
    assert scored.batch[keys.TOKEN_LEVEL_SCORES].sum(-1).tolist() == [0.5, 0.5]
    [function_pid] = map(int, scored.meta_info[keys.META_METRICS]["reward/user_rewards.compute_score/pid"])
    assert function_pid != plain_pid and psutil.pid_exists(function_pid)  # the function ran in another process
    user_modules = ray.get(
        with_user_code.workers[0].__ray_call__.remote(
            lambda _: [name for name in __import__("sys").modules if name.startswith("roll_backend_user_")]
        )
    )
    assert user_modules == []  # ... and the rank never imported it
    with_user_code.shutdown()
    assert describe(wait_until_gone([function_pid], within_s=30)) == []  # the release stopped the child

    next_group = WorkerGroup(RewardWorker, "reward", 1, worker_config=RewardWorkerConfig(rewards={"exact_match": 1.0}))
    [next_pid] = next_group.call(Worker.pid)
    assert next_pid == plain_pid  # so the process serves the next group
    next_group.shutdown()

    # A pooled process that dies while idle (the OOM killer, say) is passed over: the next group starts a new one.
    os.kill(next_pid, signal.SIGKILL)
    assert describe(wait_until_gone([next_pid], within_s=30)) == []
    after_death = WorkerGroup(RewardWorker, "reward", 1, worker_config=RewardWorkerConfig(rewards={"exact_match": 1.0}))
    [after_death_pid] = after_death.call(Worker.pid)
    assert after_death_pid != next_pid
    assert after_death.call(RewardWorker.compute_rewards, batch).batch[keys.TOKEN_LEVEL_SCORES].sum(-1).tolist() == [
        1.0,
        0.0,
    ]
    # A rank that imported user code itself (here a driver's call; a role's own code never does) is not reused.
    importer = lambda _, path=str(path): (
        __import__(  # noqa: E731
            "roll_backend.rewards.user_functions", fromlist=["_"]
        )
        .import_user_module(path)
        .__name__
    )
    assert ray.get(after_death.workers[0].__ray_call__.remote(importer)).startswith("roll_backend_user_user_rewards_")
    after_death.shutdown()
    last = WorkerGroup(RewardWorker, "reward", 1, worker_config=RewardWorkerConfig(rewards={"exact_match": 1.0}))
    assert last.call(Worker.pid) != [after_death_pid]
    last.shutdown()
