"""One-step off-policy training: the rollout group generates step k+1's batch while the actor trains on step k.

Per step k: take batch k (generated earlier), start generating batch k+1 with the weights the engine holds (one
sync behind), train on batch k (reward, reference/old log-probs, correction and updates as in the synchronous
step), wait until batch k+1 is done, then sync the weights: the engine only ever loads weights between batches.
Batch k+1 was therefore sampled by the policy of version k-1 while the trainer starts step k+1 at version k: a
staleness of one update, measured from the version each row carries, never assumed.
"""

from __future__ import annotations

import logging
import math
import time

from roll_backend import keys
from roll_backend.pipelines import steps
from roll_backend.pipelines.loop import PipelineRun, step_perf, sync_rollout_weights, train_on_batch
from roll_backend.pipelines.perf import SequenceLengths
from roll_backend.pipelines.tracking import PhaseTimer
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
        self._rank_done_times: list[float] = []  # list.append is atomic: callbacks may run on several threads
        for ref in future.refs:
            ref.future().add_done_callback(lambda _: self._rank_done_times.append(time.perf_counter()))

    @property
    def finished(self) -> float | None:
        times = list(self._rank_done_times)
        return max(times) if len(times) == len(self.future.refs) else None


class OneStepOffPolicyLoop:
    """Drives `PipelineRun`'s steps with generation one step ahead; `step(k)` returns step k's metrics."""

    def __init__(self, run: PipelineRun):
        self.run = run
        self.in_flight: _InFlight | None = None
        self.next_generation_seconds = math.nan  # wall time of run.next_batch's generation (unknown after a resume)
        self.rollout_free_since: float | None = None  # when the engine last finished a batch

    def step(self, step: int) -> dict[str, float]:
        run, timer = self.run, PhaseTimer(self.run.config.fault_tolerance.timeouts)
        trainer_waited = 0.0
        if run.next_batch is None:  # first step (or a resume without a saved batch): nothing generated yet
            start = time.perf_counter()
            self._submit(step)
            batch, generation_seconds = self._collect()
            trainer_waited += time.perf_counter() - start
        else:
            batch, generation_seconds = run.next_batch, self.next_generation_seconds
            run.next_batch = None
        rollout_idle = self._submit(step + 1) if step < run.config.max_steps else 0.0
        self._check_staleness(batch)

        generated = SequenceLengths.of(batch)
        metrics, trained = train_on_batch(run, batch, step, timer, generation_seconds)
        if self.in_flight is not None:
            start = time.perf_counter()
            run.next_batch, self.next_generation_seconds = self._collect()  # the engine is between batches now
            trainer_waited += time.perf_counter() - start
        if len(trained):
            metrics |= sync_rollout_weights(run, trained, timer)
        if math.isfinite(generation_seconds):  # (not known for a batch restored from a checkpoint)
            timer.seconds["generate"] = generation_seconds  # overlapped with training: not part of this step's wall
        metrics |= {"async/trainer_wait_s": trainer_waited, "async/rollout_idle_s": rollout_idle}
        return metrics | step_perf(run, generated, trained, timer) | timer.metrics()

    def _submit(self, step: int) -> float:
        """Start generating `step`'s batch with the engine's current weights; returns how long the engine sat idle."""
        run = self.run
        prompts = run.data.batch_at(step, run.config.rollout_batch_size)
        future = steps.submit_generate(run.groups, prompts, run.config, step)
        self.in_flight = _InFlight(future, step, run.rollout_version)
        idle = 0.0 if self.rollout_free_since is None else self.in_flight.submitted - self.rollout_free_since
        return max(idle, 0.0)

    def _collect(self) -> tuple[DataProto, float]:
        """Wait for the generation in flight; its batch stamped with the version that generated it, and its wall time."""
        in_flight, self.in_flight = self.in_flight, None
        batch = steps.collect_generated(in_flight.future)
        finished = in_flight.finished or time.perf_counter()  # the callback may trail the result by a moment
        self.rollout_free_since = finished
        steps.stamp_policy_version(batch, in_flight.version)
        return batch, finished - in_flight.submitted

    def _check_staleness(self, batch: DataProto) -> None:
        limit = self.run.config.async_generation.max_staleness
        lag = int((self.run.policy_version - batch.batch[keys.POLICY_VERSION]).max())
        if lag > limit:
            raise StalenessError(
                f"a batch generated by policy version {self.run.policy_version - lag} reached the trainer at version "
                f"{self.run.policy_version}: staleness {lag} exceeds async_generation.max_staleness={limit}"
            )
