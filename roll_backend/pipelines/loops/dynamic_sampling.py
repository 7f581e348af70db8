"""Dynamic sampling with refill (DAPO): a step trains only on prompt groups whose rewards differ (a group whose
samples all score alike has zero advantage everywhere and teaches nothing), and generates more groups until it has
rollout_batch_size of them, at most `algorithm.max_generation_rounds` rounds; then it trains on what there is.

Round 0 is the step's own prompts (the data order is the same as without dynamic sampling). A refill round draws
`refill_oversample` prompts per group still missing from the same deterministic prompt stream at positions no
training step reads, with its own sampling seed: everything depends only on (seed, step, round), so a resumed run
refills alike.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from roll_backend import keys, roles
from roll_backend.pipelines.loops import phases
from roll_backend.pipelines.services.ledger import admit_prompts, positions_of, refill_positions
from roll_backend.pipelines.services.tracking import PhaseTimer
from roll_backend.protocol import DataProto

logger = logging.getLogger(__name__)

# Refill prompts of (step, round) come from stream step REFILL_STEP_OFFSET + step * MAX_ROUNDS + round.
REFILL_STEP_OFFSET = 10**9
MAX_ROUNDS = 1024
REFILL_SEED_SALT = 100  # phases.step_seed salt of refill round r: REFILL_SEED_SALT + r


def generate_filled(run, step: int, timer: PhaseTimer) -> tuple[DataProto, dict[str, float]]:
    """(the step's batch: rollout_batch_size groups with differing rewards, or fewer after the last round, scored;
    the round-0 reward metrics and `dynamic_sampling/` metrics)."""
    config, groups, algo = run.config, run.groups, run.config.algorithm
    wanted = config.rollout_batch_size
    kept: list[DataProto] = []
    admitted: list[int] = []  # stream positions generated (round 0: the step's; later: refill positions)
    metrics: dict[str, float] = {}
    groups_kept = groups_dropped = responses_dropped = rounds = prompts_generated = 0
    while groups_kept < wanted and rounds < algo.max_generation_rounds:
        if rounds == 0:
            positions, salt = list(range(step * wanted, (step + 1) * wanted)), 0
            prompts = run.data.batch_at(step, wanted)
        else:
            size = math.ceil((wanted - groups_kept) * algo.refill_oversample)
            positions = refill_positions(step, rounds, MAX_ROUNDS, size)
            prompts = run.data.batch_at(REFILL_STEP_OFFSET + step * MAX_ROUNDS + rounds, size)
            prompts.meta_info["step"] = step
            salt = REFILL_SEED_SALT + rounds
        prompts = admit_prompts(prompts, positions, run.ledger)
        with timer.phase(roles.GENERATE):
            generated = phases.generate(groups, prompts, config, step, salt)
        prompts_generated += len(prompts)
        admitted += positions
        with timer.phase(roles.SCORE):
            scored = phases.score(groups, generated, config.reward)
        metrics = metrics or scored  # the reward of the step's own prompts, as without dynamic sampling
        varied, dropped = phases.drop_uniform_groups(generated)
        new_groups = len(np.unique(varied.non_tensor_batch[keys.UID])) if len(varied) else 0
        groups_kept += new_groups
        groups_dropped += len(np.unique(generated.non_tensor_batch[keys.UID])) - new_groups
        responses_dropped += dropped
        rounds += 1
        if len(varied):
            kept.append(varied)
    batch = first_groups(DataProto.concat(kept), wanted) if kept else generated.select_idxs([])
    run.ledger.record("filtered", sorted(set(admitted) - set(positions_of(batch))))
    filled = groups_kept >= wanted
    if not filled:
        logger.warning(
            "step %d: dynamic sampling found %d of %d prompt groups with differing rewards in %d rounds "
            "(algorithm.max_generation_rounds); training on those",
            step,
            groups_kept,
            wanted,
            rounds,
        )
    return batch, metrics | {
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/prompts": float(prompts_generated),
        "dynamic_sampling/groups_kept": float(min(groups_kept, wanted)),
        "dynamic_sampling/groups_dropped": float(groups_dropped),
        "dynamic_sampling/dropped_responses": float(responses_dropped),
        "dynamic_sampling/filled": float(filled),
    }


def first_groups(batch: DataProto, count: int) -> DataProto:
    """The rows of the first `count` prompt groups (by first appearance of their UID)."""
    uids = batch.non_tensor_batch[keys.UID]
    _, first_rows = np.unique(uids, return_index=True)
    chosen = set(uids[np.sort(first_rows)[:count]])
    return batch.select_idxs(np.flatnonzero([uid in chosen for uid in uids]))
