"""The streaming loop's bookkeeping on the driver, without Ray: which prompts it admits at which engine version (the
staleness window), which groups the trainer takes (stale ones dropped and counted, or queued to be generated again),
and what a checkpoint keeps. The groups here are made up; test_streaming.py runs the loop on real groups."""

from __future__ import annotations

import dataclasses
import tempfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from roll_backend import keys
from roll_backend.config.loader import load_config
from roll_backend.pipelines.loops.phases import step_seed
from roll_backend.pipelines.loops.streaming import (
    StreamingLoop,
    rollout_metrics_of,
    split_groups,
    token_staleness_metrics,
)
from roll_backend.pipelines.services.ledger import PromptLedger
from roll_backend.protocol import DataProto

N = 2  # samples per prompt
WIDTH = 4  # response tokens


class Prompts:
    """A data stream of 100 prompts in order: position p is prompt "p"."""

    def indices_from(self, start: int, count: int) -> np.ndarray:
        return np.arange(start, start + count) % 100

    def columns_at(self, indices) -> dict:
        return {keys.PROMPT_TEXT: np.array([str(i) for i in indices], dtype=object)}

    def batch_at(self, step: int, batch_size: int) -> DataProto:
        indices = self.indices_from(step * batch_size, batch_size)
        return DataProto.from_dict(non_tensors=self.columns_at(indices), meta_info={"step": step})


def make_loop(batch_size=3, max_staleness=1, on_stale="drop", policy_version=0, resume_state=None, next_batch=None):
    config = load_config("configs/grpo_tiny_cpu.yaml", [])
    async_generation = dataclasses.replace(
        config.async_generation, enabled=True, mode="streaming", max_staleness=max_staleness, on_stale=on_stale
    )
    run = SimpleNamespace(
        config=dataclasses.replace(config, async_generation=async_generation, rollout_batch_size=batch_size),
        policy_version=policy_version,
        rollout_version=policy_version,
        first_step=policy_version + 1,
        resume_state=resume_state or {},
        next_batch=next_batch,
        stream_checkpoint=None,
        data=Prompts(),
        groups=None,  # (dynamic sampling's scoring is stubbed where a test uses it)
        ledger=PromptLedger(tempfile.mkdtemp(prefix="ledger_")),
    )
    return StreamingLoop(run)


def ledger_events(loop) -> dict[str, list[int]]:
    """The events the loop recorded so far, by kind."""
    with loop.run.ledger.lock:
        return {event: sorted(positions) for event, positions in loop.run.ledger.pending.items()}


def finished_groups(positions: list[int], versions: list[list[int]]) -> DataProto:
    """What a rank returns for these positions: N rows each, token versions per row as given (padded with -1)."""
    rows = len(positions) * N
    token_versions = torch.full((rows, WIDTH), -1, dtype=torch.int64)
    for row, row_versions in enumerate(versions):
        token_versions[row, : len(row_versions)] = torch.as_tensor(row_versions)
    return DataProto.from_dict(
        tensors={
            keys.STREAM_POSITION: torch.as_tensor(positions).repeat_interleave(N),
            keys.TOKEN_POLICY_VERSION: token_versions,
            keys.RESPONSE_MASK: (token_versions >= 0).long(),
        }
    )


def admitted_positions(batches: list[DataProto]) -> list[list[int]]:
    return [batch.batch[keys.STREAM_POSITION].tolist() for batch in batches]


def test_prompts_are_admitted_a_step_batch_at_a_time_within_the_window():
    """max_staleness 1: two step batches ahead of the engine's version; a third only after the next sync. Each is
    the synchronous step's batch, with its seed."""
    loop = make_loop(batch_size=3, max_staleness=1)
    with loop.cond:
        first = loop._admissions()
    assert admitted_positions(first) == [[3, 4, 5], [6, 7, 8]]  # steps 1 and 2 (step s covers [3s, 3s + 3))
    assert [b.meta_info[keys.META_SAMPLING_SEED] for b in first] == [step_seed(loop.run.config, s) for s in (1, 2)]
    assert list(first[1].non_tensor_batch[keys.PROMPT_TEXT]) == ["6", "7", "8"]
    with loop.cond:
        assert loop._admissions() == [] and not loop._chunk_fits()
    loop._arrived([(finished_groups([4, 3, 5], [[0, 0]] * 6), True, {"partial_resumed_requests": 2.0})])
    batch, _ = loop._take()  # finished first, returned in stream order
    assert batch.batch[keys.STREAM_POSITION].tolist() == [3, 3, 4, 4, 5, 5]
    assert batch.batch[keys.POLICY_VERSION].tolist() == [0] * 6
    loop.consumed, loop.held = loop.consumed + loop.held, 0  # (step(): trained on)
    with loop.cond:
        assert loop._admissions() == []  # the engine still holds version 0
        loop.engine_version = 1
        assert admitted_positions(loop._admissions()) == [[9, 10, 11]]
    assert loop._counters()["partial_resumed_requests"] == 2.0


def test_zero_staleness_admits_the_next_batch_only_after_the_sync():
    loop = make_loop(batch_size=2, max_staleness=0)
    with loop.cond:
        assert admitted_positions(loop._admissions()) == [[2, 3]]
    loop._arrived([(finished_groups([2, 3], [[0, 0, 0]] * 4), False, {})])
    loop._take()
    loop.consumed, loop.held = loop.consumed + loop.held, 0
    with loop.cond:
        assert loop._admissions() == []
        loop.engine_version = 1
        assert admitted_positions(loop._admissions()) == [[4, 5]]


@pytest.mark.parametrize("on_stale", ["drop", "regenerate"])
def test_groups_older_than_the_bound_are_dropped_or_generated_again(on_stale):
    """The trainer at version 3 with max_staleness 1: a group whose oldest token is from version 1 is stale even if
    later tokens are recent (a partial rollout); it is counted and, with regenerate, admitted again first."""
    loop = make_loop(batch_size=2, max_staleness=1, on_stale=on_stale, policy_version=3)
    with loop.cond:
        loop._admissions()  # steps 4 and 5: positions 8..11
    arrived = finished_groups([8, 9, 10], [[1, 3, 3], [2, 2], [2, 3], [3], [3, 3], [3, 3]])
    loop._arrived([(arrived, True, {})])
    batch, _ = loop._take()
    assert batch.batch[keys.STREAM_POSITION].tolist() == [9, 9, 10, 10]
    counters = loop._counters()
    assert counters["dropped_stale_groups"] == 1.0
    assert counters["regenerated_groups"] == (1.0 if on_stale == "regenerate" else 0.0)
    assert loop.readmit == ([8] if on_stale == "regenerate" else [])
    event = "regenerate" if on_stale == "regenerate" else "dropped_stale"
    assert ledger_events(loop) == {"admitted": [8, 9, 10, 11], event: [8]}
    metrics = token_staleness_metrics(batch, trainer_version=3, max_staleness=1)
    assert metrics["async/token_staleness_max"] == 1.0 and metrics["async/token_lag_0"] == pytest.approx(6 / 7)
    assert metrics["async/sample_lag_1"] == 0.25 and metrics["async/mixed_version_samples"] == 0.25
    if on_stale == "regenerate":
        with loop.cond:
            again = loop._admissions()
        assert admitted_positions(again)[0] == [8] and list(again[0].non_tensor_batch[keys.PROMPT_TEXT]) == ["8"]
        assert ledger_events(loop)["admitted"] == [8, 8, 9, 10, 11]  # 8 generated again


def test_a_checkpoint_keeps_the_buffer_and_the_positions_in_flight():
    loop = make_loop(batch_size=2, max_staleness=1)
    with loop.cond:
        loop._admissions()  # positions 2..5
    loop._arrived([(finished_groups([3], [[0]] * 2), True, {})])
    buffered, state = loop.checkpoint_state()
    assert buffered.batch[keys.STREAM_POSITION].tolist() == [3, 3]
    assert state == {"stream": {"next_chunk": 3, "in_flight": [2, 4, 5]}}
    resumed = make_loop(batch_size=2, max_staleness=1, resume_state=state, next_batch=buffered)
    assert [g.batch[keys.STREAM_POSITION].tolist() for g in resumed.buffer] == [[3, 3]]
    with resumed.cond:
        again = resumed._admissions()
    assert admitted_positions(again) == [[2, 4, 5]]  # generated again; the window is full with them
    assert ledger_events(resumed) == {"admitted": [2, 4, 5]}
    resumed.__exit__(None, None, None)  # the run ends: what it looked ahead to is recorded as such
    assert ledger_events(resumed) == {"admitted": [2, 4, 5], "unfinished_at_end": [2, 3, 4, 5]}
    assert len(split_groups(buffered)) == 1


@pytest.mark.parametrize("rounds", [4, 1])
def test_dynamic_sampling_drops_uniform_groups_as_taken_and_admits_more(monkeypatch, rounds):
    """Groups whose samples all score alike are dropped as the trainer takes them; the room they leave lets the pump
    admit more prompts, and the trainer takes more groups until the batch is full, scoring at most
    max_generation_rounds x rollout_batch_size groups a step (then it trains on what it kept)."""
    from roll_backend.pipelines.loops import streaming

    scores = {2: [1.0, 1.0], 3: [0.0, 1.0], 4: [0.0, 0.0], 5: [1.0, 0.0]}  # per position, one per sample

    def score(groups, batch, reward):
        rows = [scores[p][i % N] for i, p in enumerate(batch.batch[keys.STREAM_POSITION].tolist())]
        token_scores = torch.zeros(len(batch), WIDTH)
        token_scores[:, 0] = torch.tensor(rows)
        batch[keys.TOKEN_LEVEL_SCORES] = token_scores
        return {"reward/mean": float(np.mean(rows))}

    monkeypatch.setattr(streaming.phases, "score", score)
    loop = make_loop(batch_size=2, max_staleness=1)
    algorithm = dataclasses.replace(loop.run.config.algorithm, dynamic_sampling=True, max_generation_rounds=rounds)
    loop.run.config = dataclasses.replace(loop.run.config, algorithm=algorithm)
    with loop.cond:
        loop._admissions()  # positions 2..5
    groups = finished_groups([2, 3, 4, 5], [[0]] * 8)
    groups.non_tensor_batch[keys.UID] = np.repeat(np.array(["a", "b", "c", "d"], dtype=object), N)
    loop._arrived([(groups, False, {})])
    batch, metrics = loop._take()
    kept = [3, 5] if rounds == 4 else [3]
    assert batch.batch[keys.STREAM_POSITION].unique().tolist() == kept and loop.held == len(kept)
    assert metrics["dynamic_sampling/groups_scored"] == (4 if rounds == 4 else 2)
    assert metrics["dynamic_sampling/groups_kept"] == len(kept)
    assert metrics["dynamic_sampling/dropped_responses"] == (2 * N if rounds == 4 else N)
    assert ledger_events(loop)["filtered"] == ([2, 4] if rounds == 4 else [2])
    if rounds == 4:
        with loop.cond:  # two groups dropped: a step batch fits the window again
            assert admitted_positions(loop._admissions()) == [[6, 7]]


def test_a_steps_rollout_metrics_are_those_of_its_groups():
    """Two trained groups: one of 2 rows out of a call that returned 4 (success 0.5, 3 tool calls), one of 2 rows that
    came back alone (success 1.0, 1 tool call). Means weigh rows; counts go in proportion; a call's timings stay out."""
    shares = [
        (2, 4, {"agentic/success_rate": 0.5, "agentic/tool_calls_count": 3.0, "rollout/generate_s": 9.0}),
        (2, 2, {"agentic/success_rate": 1.0, "agentic/tool_calls_count": 1.0}),
    ]
    assert rollout_metrics_of(shares) == {"agentic/success_rate": 0.75, "agentic/tool_calls_count": 2.5}
    assert rollout_metrics_of([]) == {}
