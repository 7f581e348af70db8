"""One-step off-policy training: the rollout group generates step k+1's batch while the actor trains on step k.

Per step k: take batch k (generated earlier), start generating batch k+1 with the weights the engine holds (one
sync behind), train on batch k (reward, reference/old log-probs, correction and updates as in the synchronous
step), wait until batch k+1 is done, then sync the weights: the engine only ever loads weights between batches.
Batch k+1 was therefore sampled by the policy of version k-1 while the trainer starts step k+1 at version k: a
staleness of one update, measured from the version each row carries, never assumed.

With `async_generation.prepare_ahead`, a driver thread also scores batch k+1 and computes its reference log-probs
(`rl_step.prepare_batch`: models that do not train) as soon as it is generated, while the actor still trains on batch
k; the trainer's half of a step is then the updates and the weight sync. Placed on the rollout's devices, the
reference uses the time the engine would otherwise wait for the next sync.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor

from roll_backend import keys, roles
from roll_backend.pipelines.loops import phases
from roll_backend.pipelines.loops.rl_step import (
    mark_prepared,
    prepare_batch,
    step_perf,
    step_prompts,
    sync_rollout_weights,
    train_on_batch,
)
from roll_backend.pipelines.run import PipelineRun
from roll_backend.pipelines.services.phase_perf import SequenceLengths
from roll_backend.pipelines.services.tracking import PhaseTimer
from roll_backend.protocol import DataProto

logger = logging.getLogger(__name__)


class StalenessError(RuntimeError):
    """A batch's rows were generated further behind the trainer than async_generation.max_staleness allows."""


class _InFlight:
    """A generation started on the rollout group: its future, the step it serves, the weights' version, and the
    driver-clock times it was submitted and finished (a Ray callback stamps the finish without blocking)."""

    def __init__(self, future, step: int, version: int):
        self.future, self.step, self.version = future, step, version
        self.submitted = time.perf_counter()
        self.prepared: Future | None = None  # prepare_ahead: the driver thread's `_finish` result
        self._rank_done_times: list[float] = []  # list.append is atomic: callbacks may run on several threads
        for ref in future.refs:
            ref.future().add_done_callback(lambda _: self._rank_done_times.append(time.perf_counter()))

    @property
    def finished(self) -> float | None:
        times = list(self._rank_done_times)
        return max(times) if len(times) == len(self.future.refs) else None


class OneStepOffPolicyLoop:
    """Drives `PipelineRun`'s steps with generation one step ahead; `step(k)` returns step k's metrics. A context
    manager (it may own a preparation thread)."""

    def __init__(self, run: PipelineRun):
        self.run = run
        self.in_flight: _InFlight | None = None
        self.preparer = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare-ahead")
            if run.config.async_generation.prepare_ahead
            else None
        )
        # Of run.next_batch when this loop collected it (after a resume: unknown, and recounted from the batch).
        self.next_generation_seconds = math.nan
        self.next_generated: SequenceLengths | None = None
        self.rollout_free_since: float | None = None  # when the engine last finished a batch

    def step(self, step: int) -> dict[str, float]:
        run, timer = self.run, PhaseTimer(self.run.config.fault_tolerance.timeouts)
        trainer_waited = 0.0
        if run.next_batch is None:  # first step (or a resume without a saved batch): nothing generated yet
            start = time.perf_counter()
            self._submit(step)
            batch, generation_seconds, generated = self._collect()
            trainer_waited += time.perf_counter() - start
        else:
            batch, generation_seconds = run.next_batch, self.next_generation_seconds
            generated = self.next_generated if self.next_generated is not None else SequenceLengths.of(batch)
            run.next_batch = None
        rollout_idle = self._submit(step + 1) if step < run.config.max_steps else 0.0
        self._check_staleness(batch)

        prepared_ahead = float(keys.META_PREPARED in batch.meta_info)
        metrics, trained = train_on_batch(run, batch, step, timer, generation_seconds)
        if self.in_flight is not None:
            start = time.perf_counter()
            run.next_batch, self.next_generation_seconds, self.next_generated = (
                self._collect()
            )  # engine between batches
            trainer_waited += time.perf_counter() - start
        if len(trained):
            metrics |= sync_rollout_weights(run, trained, timer, step)
        if math.isfinite(generation_seconds):  # (not known for a batch restored from a checkpoint)
            timer.seconds[roles.GENERATE] = generation_seconds  # overlapped with training: not part of this step's wall
        metrics |= {
            "async/trainer_wait_s": trainer_waited,
            "async/rollout_idle_s": rollout_idle,
            "async/prepared_ahead": prepared_ahead,
        }
        return metrics | step_perf(run, generated, trained, timer) | timer.metrics()

    def _submit(self, step: int) -> float:
        """Start generating `step`'s batch with the engine's current weights; returns how long the engine sat idle."""
        run = self.run
        prompts = step_prompts(run, step)
        future = phases.submit_generate(run.groups, prompts, run.config, step)
        self.in_flight = _InFlight(future, step, run.rollout_version)
        if self.preparer is not None:
            self.in_flight.prepared = self.preparer.submit(self._finish, self.in_flight, prepare=True)
        idle = 0.0 if self.rollout_free_since is None else self.in_flight.submitted - self.rollout_free_since
        return max(idle, 0.0)

    def _collect(self) -> tuple[DataProto, float, SequenceLengths]:
        """Wait for the generation in flight (and its preparation, if ahead): its batch, stamped with the version
        that generated it, the generation's wall time and the generated lengths (before dynamic sampling)."""
        in_flight, self.in_flight = self.in_flight, None
        return in_flight.prepared.result() if in_flight.prepared is not None else self._finish(in_flight)

    def _finish(self, in_flight: _InFlight, prepare: bool = False) -> tuple[DataProto, float, SequenceLengths]:
        batch = phases.collect_generated(in_flight.future)
        finished = in_flight.finished or time.perf_counter()  # the callback may trail the result by a moment
        self.rollout_free_since = finished
        phases.stamp_policy_version(batch, in_flight.version)
        seconds, generated = finished - in_flight.submitted, SequenceLengths.of(batch)
        if prepare:
            timer = PhaseTimer(self.run.config.fault_tolerance.timeouts)
            metrics, batch = prepare_batch(self.run, batch, timer, seconds)
            mark_prepared(batch, metrics, timer.seconds)
        return batch, seconds, generated

    def __enter__(self) -> OneStepOffPolicyLoop:
        return self

    def __exit__(self, *exc) -> None:
        """Stop the preparation thread; a preparation still running ends with the groups' shutdown."""
        if self.preparer is not None:
            self.preparer.shutdown(wait=False, cancel_futures=True)

    def _check_staleness(self, batch: DataProto) -> None:
        if len(batch) == 0:  # dynamic sampling (prepared ahead) kept no row
            return
        limit = self.run.config.async_generation.max_staleness
        lag = int((self.run.policy_version - batch.batch[keys.POLICY_VERSION]).max())
        if lag > limit:
            raise StalenessError(
                f"a batch generated by policy version {self.run.policy_version - lag} reached the trainer at version "
                f"{self.run.policy_version}: staleness {lag} exceeds async_generation.max_staleness={limit}"
            )
