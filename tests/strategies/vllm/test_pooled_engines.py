"""The rank pool (roll_backend/distributed/rank_pool.py) with vLLM: an engine stopped in place (its engine core's own
tear-down) leaves a process that starts the next group's engine, and that engine samples what a fresh process's does:
the same model at TP2 gives the same greedy tokens and log-probs, bit for bit, in the processes another model's engine
at TP1 used in between (a stale engine, KV cache or process group would change them or hang). A stopped engine leaves
nothing behind: the objects each process keeps frozen from the garbage collector (its imports:
roll_backend/distributed/heap.py) are as many after the third engine as after the first (an engine frozen with them
would add its own). The same processes then serve a Megatron reference's ranks (another worker class: every rank's
actor is a RankHost) with a fresh rank's numbers. A process whose engine failed to start is not reused."""

from __future__ import annotations

import os

import numpy as np
import pytest
import ray
import torch

from roll_backend import keys
from roll_backend.distributed import rank_pool
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.distributed.worker import Worker
from roll_backend.distributed.worker_group import RankRaisedError, WorkerGroup
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import MegatronInferConfig
from roll_backend.strategies.vllm.config import SamplingConfig, VllmRolloutConfig
from roll_backend.workers.reference import ReferenceConfig, ReferenceWorker
from roll_backend.workers.rollout import RolloutWorker, RolloutWorkerConfig

PROMPTS = ["copy 12345", "add 10", "sum 3 4"]


@pytest.fixture
def empty_pool(ray_session):
    rank_pool.enable_rank_pool(False)
    rank_pool.enable_rank_pool()
    yield
    rank_pool.enable_rank_pool(False)
    rank_pool.enable_rank_pool()


def _engine_group(model_path: str, world_size: int, tp: int, start: bool = True, **settings) -> WorkerGroup:
    config = RolloutWorkerConfig(
        strategy=VllmRolloutConfig(
            model_path=model_path,
            max_model_len=256,
            max_prompt_length=32,
            sampling=SamplingConfig(n=1, temperature=0.0, max_tokens=8),
            **settings,
        )
    )
    group = WorkerGroup(RolloutWorker, "rollout", world_size, ParallelLayout(tp=tp), worker_config=config)
    if start:
        group.call(RolloutWorker.init_model)
    return group


def _frozen_objects(handles: list) -> list[int]:
    """How many objects each idle process's garbage collector keeps frozen (what its releases left: its imports)."""
    import ray

    return ray.get([handle.__ray_call__.remote(lambda _: __import__("gc").get_freeze_count()) for handle in handles])


def _greedy(group: WorkerGroup) -> DataProto:
    prompts = np.array(PROMPTS, dtype=object)
    return group.call(RolloutWorker.generate, DataProto.from_dict(non_tensors={keys.PROMPT_TEXT: prompts}))


def _tokens_and_log_probs(sampled: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
    return sampled.batch[keys.RESPONSES], sampled.batch[keys.ROLLOUT_LOG_PROBS]


def test_an_engine_in_a_reused_process_samples_as_in_a_fresh_one(empty_pool, tmp_path):
    spec = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    first, other = (str(build_tiny_model(tmp_path / f"m{seed}", TinyModelSpec(**spec, seed=seed))) for seed in (3, 4))

    fresh = _engine_group(first, 2, 2)
    fresh_pids = fresh.call(Worker.pid)
    fresh_tokens, fresh_log_probs = _tokens_and_log_probs(_greedy(fresh))
    handles = list(fresh.workers)
    fresh.shutdown()
    after_first = _frozen_objects(handles)

    between = _engine_group(other, 1, 1)
    assert between.call(Worker.pid)[0] in fresh_pids
    other_tokens, _ = _tokens_and_log_probs(_greedy(between))
    assert not torch.equal(other_tokens, fresh_tokens)  # (so equal tokens below are not the pool's doing)
    between.shutdown()

    again = _engine_group(first, 2, 2)
    assert sorted(again.call(Worker.pid)) == sorted(fresh_pids)
    sampled = _greedy(again)
    tokens, log_probs = _tokens_and_log_probs(sampled)
    assert torch.equal(tokens, fresh_tokens) and torch.equal(log_probs, fresh_log_probs)
    again.shutdown()
    after_third = _frozen_objects(handles)
    # (measured: 2.6-3.4 k more, what vLLM's and torch's registries keep of each engine; 8-13 k with each engine
    # frozen after its start)
    assert all(third < first + 5000 for first, third in zip(after_first, after_third)), (after_first, after_third)
    # Idle, each process has the environment it started with (the engine sets its own variables).
    engine_variable = lambda _: os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")  # noqa: E731  (by value, not by name)
    variables = ray.get([handle.__ray_call__.remote(engine_variable) for handle in handles])
    assert set(variables) == {os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")}

    # A Megatron rank of another worker class in those processes: its log-probs of the engine's samples are the
    # engine's (a stale engine or process group would break them).
    reference = _reference_group(first, 2)
    assert sorted(reference.call(Worker.pid)) == sorted(fresh_pids)
    gap = (reference.call(ReferenceWorker.compute_log_probs, sampled).batch[keys.LOG_PROBS] - log_probs).abs()
    assert gap[sampled.batch[keys.RESPONSE_MASK].bool()].max() < 1e-4
    reference.shutdown()

    # An engine that fails to start (no room for its KV cache: vLLM refuses it after it
    # set up its parallel groups) does not give its process back: the next group there would find vLLM's groups.
    pool, unclean = rank_pool.current_pool(), rank_pool.current_pool().unclean
    failed = _engine_group(first, 1, 1, start=False, cpu_kvcache_space_gib=1e-6)
    with pytest.raises(RankRaisedError, match="cache"):
        failed.call(RolloutWorker.init_model)
    failed.shutdown()  # (a rank that raised leaves its group healthy: its processes go back to the pool, if clean)
    assert pool.unclean == unclean + 1  # stopped at its release, not kept idle


def _reference_group(model_path: str, tp: int) -> WorkerGroup:
    config = ReferenceConfig(strategy=MegatronInferConfig(model_path=model_path, micro_batch_size=2))
    group = WorkerGroup(ReferenceWorker, "reference", tp, ParallelLayout(tp=tp), worker_config=config)
    group.call(ReferenceWorker.init_model)
    return group
