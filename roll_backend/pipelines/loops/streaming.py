"""Streaming asynchronous training (async_generation.mode: streaming): the rollout takes prompts continuously, groups
go to a bounded buffer as soon as their n samples finish, and the trainer takes `rollout_batch_size` groups per step.

A driver thread (the pump) admits prompts and steps the engines a few steps per call (RolloutWorker.stream_admit /
stream_run); the trainer thread trains and syncs the weights, which the rollout ranks load between two of the
pump's calls with the requests in flight kept, recomputed or resubmitted (`partial_rollout`, see
strategies/vllm/stream_session.py). Rollout ranks stay single-threaded Ray actors: Ray runs their calls one at a time.

Staleness is bounded per sample (AReaL's rule): prompts are admitted a step's batch at a time, while the groups
consumed, held and pending stay under (engine version + max_staleness + 1) x rollout_batch_size, so in admission
order a group is trained at most max_staleness updates after its first token; a group whose oldest token is
older than that when the trainer takes it (a long tail that outlived the window) is dropped or generated again
(`on_stale`). With max_staleness 0 a batch is admitted only when the engine holds the trainer's weights, and is
admitted, seeded, split over DP ranks and stepped as the synchronous `generate` does: the run repeats the
synchronous one exactly.

Checkpoints keep the buffer's finished groups (with their token versions; the staleness rule applies to them after
a resume) and the stream positions in flight, which a resumed run generates again from their prompts.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from roll_backend import keys, roles
from roll_backend.pipelines.loops import phases
from roll_backend.pipelines.loops.rl_step import step_perf, sync_rollout_weights, train_on_batch
from roll_backend.pipelines.run import PipelineRun
from roll_backend.pipelines.services.ledger import positions_of
from roll_backend.pipelines.services.phase_perf import SequenceLengths
from roll_backend.pipelines.services.tracking import PhaseTimer, phase_deadline
from roll_backend.protocol import DataProto
from roll_backend.workers.rollout import RolloutWorker

logger = logging.getLogger(__name__)

REGENERATE_SALT = 1_000  # step_seed salt of a regeneration admission (stale groups, in flight at a checkpoint)


class StreamingLoop:
    """Drives `PipelineRun`'s steps in streaming mode; `step(k)` returns step k's metrics. A context manager: it owns
    the pump thread."""

    def __init__(self, run: PipelineRun):
        config = run.config
        self.run = run
        self.cfg = config.async_generation
        self.batch_size = config.rollout_batch_size
        self.cond = threading.Condition()
        self.buffer: list[DataProto] = []  # finished groups (n rows each), oldest first
        self.in_flight: set[int] = set()  # stream positions admitted and not finished
        self.held = 0  # groups the trainer has taken but not yet kept or dropped
        self.consumed = run.policy_version * self.batch_size  # groups trained on (counted to the trainer version)
        self.engine_version = run.rollout_version
        self.ranks_busy = False  # some rank still has requests (also dispatch padding, which we never see)
        self.stopping = False
        self.failure: BaseException | None = None
        self.counters = dict.fromkeys(
            ("dropped_stale_groups", "regenerated_groups", "partial_resumed_requests", "recomputed_tokens"), 0.0
        )
        self.engine_idle_s = self.engine_busy_s = 0.0
        # Stream position -> (its rows, the rows that arrived with it, the rank's metrics of that arrival).
        self.group_metrics: dict[int, tuple[int, int, dict]] = {}
        self.regenerations = 0
        saved = run.resume_state.get("stream", {})
        self.next_chunk = saved.get("next_chunk", run.first_step)  # the data stream's batch index admitted next
        self.readmit: list[int] = list(saved.get("in_flight", []))  # positions to generate again
        if run.next_batch is not None:  # the buffer as the checkpoint saved it
            self.buffer = split_groups(run.next_batch)
            run.next_batch = None
        run.stream_checkpoint = self.checkpoint_state
        self.pump = threading.Thread(target=self._pump, name="stream-pump", daemon=True)

    # ---- the trainer's side ------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        run, timer = self.run, PhaseTimer(self.run.config.fault_tolerance.timeouts)
        start = time.perf_counter()
        batch, take_metrics = self._take()
        trainer_waited = time.perf_counter() - start
        with self.cond:
            generating, self.engine_busy_s = self.engine_busy_s, 0.0
            idle, self.engine_idle_s = self.engine_idle_s, 0.0
            depth = len(self.buffer)
            shares = [self.group_metrics.pop(p) for p in positions(batch) if p in self.group_metrics]
        generated = SequenceLengths.of(batch)
        metrics, trained = train_on_batch(run, batch, step, timer, generating)
        with self.cond:
            self.consumed += self.held
            self.held = 0
        if self.cfg.max_staleness == 0:
            self._wait_until_engines_idle()  # the synchronous order: no generation during the sync
        if len(trained):
            metrics |= sync_rollout_weights(run, trained, timer, step, in_flight=self.cfg.partial_rollout)
        with self.cond:
            self.engine_version = run.rollout_version
            self.cond.notify_all()
        timer.seconds[roles.GENERATE] = generating  # engine time since the last step, overlapped with training
        metrics |= take_metrics | token_staleness_metrics(trained, run.policy_version - 1, self.cfg.max_staleness)
        metrics |= rollout_metrics_of(shares)
        metrics |= {
            "async/trainer_wait_s": trainer_waited,
            "async/rollout_idle_s": idle,
            "stream/buffer_groups": float(depth),
            **{f"stream/{name}": value for name, value in self._counters().items()},
        }
        return metrics | step_perf(run, generated, trained, timer) | timer.metrics()

    def _take(self) -> tuple[DataProto, dict[str, float]]:
        """`rollout_batch_size` groups from the buffer, oldest first, fresh enough for the trainer's version (stale
        ones dropped or queued again); with dynamic sampling, scored, and groups of equal rewards dropped until the
        batch is full. Sorted by stream position: at max_staleness 0 that is the synchronous batch's row order."""
        run, algo = self.run, self.run.config.algorithm
        kept: list[DataProto] = []
        metrics: dict[str, list[float]] = {}
        scored_limit = algo.max_generation_rounds * self.batch_size  # dynamic sampling: groups scored per step
        scored, empty = 0, None
        while len(kept) < self.batch_size:
            if algo.dynamic_sampling and scored >= scored_limit:
                logger.warning(
                    "dynamic sampling: %d of %d groups with differing rewards after scoring %d; training on those",
                    len(kept),
                    self.batch_size,
                    scored,
                )
                break
            fresh = self._drop_stale(self._wait_for_groups(self.batch_size - len(kept)))
            if algo.dynamic_sampling and fresh:
                batch = DataProto.concat(fresh)
                for name, value in phases.score(run.groups, batch, run.config.reward).items():
                    metrics.setdefault(name, []).append(value)
                informative, dropped = phases.drop_uniform_groups(batch)
                metrics.setdefault("dynamic_sampling/dropped_responses", []).append(float(dropped))
                scored, empty = scored + len(fresh), informative[:0]
                uniform = len(fresh)
                fresh = split_groups(informative) if len(informative) else []
                with self.cond:  # dropped groups leave room in the window: the pump admits more
                    self.held -= uniform - len(fresh)
                    filtered = set(positions(batch)) - set(positions(informative))
                    self._forget_metrics(filtered)
                    self.run.ledger.record("filtered", sorted(filtered))
                    self.cond.notify_all()
            kept += fresh
        kept.sort(key=lambda group: int(group.batch[keys.STREAM_POSITION][0]))
        batch = DataProto.concat(kept) if kept else empty
        summed = {
            name: float(np.sum(values) if name.endswith("dropped_responses") else np.mean(values))
            for name, values in metrics.items()
        }
        if algo.dynamic_sampling:
            summed |= {
                "dynamic_sampling/groups_scored": float(scored),
                "dynamic_sampling/groups_kept": float(len(kept)),
            }
        return batch, summed

    def _wait_for_groups(self, wanted: int) -> list[DataProto]:
        with self.cond:
            while not self.buffer and self.failure is None:
                self.cond.wait()
            if self.failure is not None:
                raise self.failure
            taken, self.buffer = self.buffer[:wanted], self.buffer[wanted:]
            self.held += len(taken)
            return taken

    def _drop_stale(self, groups: list[DataProto]) -> list[DataProto]:
        """The groups whose oldest token is at most max_staleness updates behind the trainer; the others are counted
        and dropped, or queued to be generated again (on_stale: regenerate)."""
        trainer_version, limit = self.run.policy_version, self.cfg.max_staleness
        fresh = [g for g in groups if trainer_version - oldest_version(g) <= limit]
        stale = [g for g in groups if trainer_version - oldest_version(g) > limit]
        if stale:
            with self.cond:
                self.held -= len(stale)
                self._forget_metrics({int(g.batch[keys.STREAM_POSITION][0]) for g in stale})
                self.counters["dropped_stale_groups"] += len(stale)
                stale_positions = [int(g.batch[keys.STREAM_POSITION][0]) for g in stale]
                regenerate = self.cfg.on_stale == "regenerate"
                self.run.ledger.record("regenerate" if regenerate else "dropped_stale", stale_positions)
                if regenerate:
                    self.readmit += stale_positions
                    self.counters["regenerated_groups"] += len(stale)
                self.cond.notify_all()
        return fresh

    def _forget_metrics(self, dropped: set[int]) -> None:
        for position in dropped:
            self.group_metrics.pop(position, None)

    def _wait_until_engines_idle(self) -> None:
        with self.cond:
            while (self.ranks_busy or self.in_flight) and self.failure is None:
                self.cond.wait()
            if self.failure is not None:
                raise self.failure

    def _counters(self) -> dict[str, float]:
        with self.cond:
            counters = dict(self.counters)
            self.counters = dict.fromkeys(self.counters, 0.0)
        return counters

    # ---- the pump ----------------------------------------------------------------------------------------
    def _pump(self) -> None:
        group = self.run.groups.actor_infer
        try:
            while True:
                with self.cond:
                    idle_since = time.perf_counter()
                    while not self.stopping and not self._pump_has_work():
                        self.cond.wait()
                    self.engine_idle_s += time.perf_counter() - idle_since
                    if self.stopping:
                        return
                    admissions = self._admissions()
                start = time.perf_counter()
                # Each call under the generate deadline: a hung rollout rank fails the run (and restarts it).
                with phase_deadline(self.run.timeouts, roles.GENERATE):
                    for prompts in admissions:
                        group.call(RolloutWorker.stream_admit, prompts)
                    results = group.call(RolloutWorker.stream_run, self.cfg.steps_per_call)
                with self.cond:
                    self.engine_busy_s += time.perf_counter() - start
                    self._arrived(results)
                    self.cond.notify_all()
        except BaseException as exc:  # the trainer thread raises it at its next wait
            with self.cond:
                self.failure = exc
                self.cond.notify_all()

    def _pump_has_work(self) -> bool:
        return bool(self.in_flight or self.ranks_busy or self.readmit or self._chunk_fits())

    def _chunk_fits(self) -> bool:
        live = self.consumed + self.held + len(self.buffer) + len(self.in_flight) + len(self.readmit)
        return live + self.batch_size <= (self.engine_version + self.cfg.max_staleness + 1) * self.batch_size

    def _admissions(self) -> list[DataProto]:
        """(Under the lock.) The prompt batches to admit now: a queue of positions to generate again, then whole
        step batches of the data stream while the staleness window has room."""
        run, batches = self.run, []
        if self.readmit:
            positions, self.readmit = self.readmit, []
            self.regenerations += 1
            seed = phases.step_seed(run.config, self.next_chunk, salt=REGENERATE_SALT + self.regenerations)
            batches.append(self._prompts(positions, seed))
        while self._chunk_fits():
            chunk = self.next_chunk
            positions = list(range(chunk * self.batch_size, (chunk + 1) * self.batch_size))
            # The prompts and seed of the synchronous step `chunk`'s generate.
            batches.append(self._prompts(positions, phases.step_seed(run.config, chunk), step=chunk))
            self.next_chunk += 1
        return batches

    def _prompts(self, positions: list[int], seed: int, step: int | None = None) -> DataProto:
        """(Under the lock.) The prompts at these stream positions, tagged with them; now in flight."""
        data = self.run.data
        if step is not None:
            base = data.batch_at(step, self.batch_size)
            columns, meta = base.non_tensor_batch, base.meta_info
        else:
            columns, meta = data.columns_at(np.concatenate([data.indices_from(p, 1) for p in positions])), {}
        self.in_flight.update(positions)
        self.run.ledger.record("admitted", positions)
        return DataProto.from_dict(
            tensors={keys.STREAM_POSITION: torch.as_tensor(positions, dtype=torch.int64)},
            non_tensors=columns,
            meta_info={**meta, keys.META_SAMPLING_SEED: seed},
        )

    def _arrived(self, results: list) -> None:
        """(Under the lock.) Each rank's finished groups into the buffer; its counters into ours."""
        busy = False
        for finished, unfinished, stats in results:
            busy |= unfinished
            for name in ("partial_resumed_requests", "recomputed_tokens"):
                self.counters[name] += stats.get(name, 0.0)
            if finished is None:
                continue
            metrics = finished.meta_info.pop(keys.META_METRICS, None) or {}
            phases.stamp_policy_version(finished)
            for group in split_groups(finished):
                position = int(group.batch[keys.STREAM_POSITION][0])
                if position in self.in_flight:  # (a position generated twice, e.g. regenerated, counts once)
                    self.in_flight.discard(position)
                    self.buffer.append(group)
                    self.group_metrics[position] = (len(group), len(finished), metrics)
        self.ranks_busy = busy

    # ---- checkpoints and shutdown --------------------------------------------------------------------------
    def checkpoint_state(self) -> tuple[DataProto | None, dict]:
        """What a checkpoint keeps of the stream: the finished groups, and the positions to generate again."""
        with self.cond:
            buffered = DataProto.concat(self.buffer) if self.buffer else None
            state = {"next_chunk": self.next_chunk, "in_flight": sorted(self.in_flight) + list(self.readmit)}
        return buffered, {"stream": state}

    def __enter__(self) -> StreamingLoop:
        self.pump.start()
        return self

    def __exit__(self, *exc) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.pump.is_alive():
            self.pump.join(timeout=60)  # its current call returns within steps_per_call engine steps
        self.run.stream_checkpoint = None
        with self.cond:  # the look-ahead the run ended with
            left = [p for group in self.buffer for p in positions(group)] + sorted(self.in_flight) + self.readmit
        self.run.ledger.record("unfinished_at_end", left)


# A call's own timings: the step's throughput is step_perf's (perf/...), over the whole step.
CALL_TIMINGS = ("rollout/generate_s", "rollout/tokens_per_s")


def rollout_metrics_of(shares: list[tuple[int, int, dict]]) -> dict[str, float]:
    """The rollout ranks' metrics (rollout/..., agentic/...) of the rank calls the trained groups finished in, each
    call's metrics weighted by the rows of its groups trained now: (those rows, the call's rows, the call's metrics).
    Counts (`*_count`) in proportion to the rows, the rest averaged. A call's metrics cover all its groups, so this
    approximates the trained groups' own values (exact when every call returned only trained groups)."""
    values: dict[str, list[tuple[int, int, float]]] = {}
    for rows, arrived, metrics in shares:
        for name, value in metrics.items():
            if name not in CALL_TIMINGS:
                values.setdefault(name, []).append((rows, arrived, float(value)))
    return {
        name: float(sum(v * rows / arrived for rows, arrived, v in parts))
        if name.endswith("_count")
        else float(np.average([v for _, _, v in parts], weights=[rows for rows, _, _ in parts]))
        for name, parts in values.items()
    }


positions = positions_of


def split_groups(batch: DataProto) -> list[DataProto]:
    """A rollout batch cut into its prompt groups (rows sharing a stream position, adjacent)."""
    positions = batch.batch[keys.STREAM_POSITION].tolist()
    starts = [i for i in range(len(positions)) if i == 0 or positions[i] != positions[i - 1]]
    ends = starts[1:] + [len(positions)]
    return [batch.select_idxs(list(range(start, end))) for start, end in zip(starts, ends)]


def oldest_version(group: DataProto) -> int:
    return int(group.batch[keys.POLICY_VERSION].min())


def token_staleness_metrics(batch: DataProto, trainer_version: int, max_staleness: int) -> dict[str, float]:
    """Per token and per sample: how many updates behind the trainer (before this step's update) each was sampled,
    as a histogram (fraction per lag, lags above max_staleness in the last bin) and its mean and max."""
    if len(batch) == 0:
        return {}
    versions = batch.batch[keys.TOKEN_POLICY_VERSION]
    sampled = versions >= 0
    token_lag = (trainer_version - versions)[sampled]
    sample_lag = trainer_version - batch.batch[keys.POLICY_VERSION]
    metrics = {
        "async/token_staleness_mean": float(token_lag.float().mean()) if len(token_lag) else 0.0,
        "async/token_staleness_max": float(token_lag.max()) if len(token_lag) else 0.0,
        "async/mixed_version_samples": float(
            (versions.amax(-1) != batch.batch[keys.POLICY_VERSION]).float().mean()  # (-1 where none sampled)
        ),
    }
    for lag in range(max_staleness + 2):
        top = lag == max_staleness + 1
        metrics[f"async/token_lag_{lag}{'+' if top else ''}"] = float(
            ((token_lag >= lag) if top else (token_lag == lag)).float().mean()
        )
        metrics[f"async/sample_lag_{lag}{'+' if top else ''}"] = float(
            ((sample_lag >= lag) if top else (sample_lag == lag)).float().mean()
        )
    return metrics
