"""The run's vocabulary of roles and phases, beside `keys.py` (which names batch columns). No imports.

Every table about roles or phases derives from here: the config's role blocks, the validator's checks, the
groups a run starts (named by their role), each phase's deadline setting and MFU role, and the worker methods
fault injection may target. Adding a role or a phase is one line here plus the code that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

# ---- roles: one name each, used for config blocks, groups, logs and fault injection ------------------------------
ACTOR_TRAIN = "actor_train"  # the trained policy (Megatron train strategy)
ACTOR_INFER = "actor_infer"  # the rollout engine generating from the policy (vLLM)
REFERENCE = "reference"  # the frozen reference policy (KL)
CRITIC = "critic"  # the value model (PPO with GAE)
REWARD = "reward"  # rule rewards and user reward functions
REWARD_MODEL = "reward_model"  # a trained reward model scoring responses (Megatron, value head)
TEACHER = "teacher"  # the teacher of on-policy distillation (log-probs of the student's samples)

# the hybrid engine's group: actor_train's processes hosting the hybrid roles (workers/hybrid.py); not a config block
HYBRID = "hybrid"

# config blocks with a model path and a strategy
MODEL_ROLES = (ACTOR_TRAIN, ACTOR_INFER, REFERENCE, CRITIC, REWARD_MODEL, TEACHER)
# a run may leave these out (null in the config); actor_infer only in the offline pipelines (sft, reward_model, dpo)
OPTIONAL_ROLES = (ACTOR_INFER, REFERENCE, CRITIC, REWARD_MODEL, TEACHER)
ROLES = (*MODEL_ROLES, REWARD)

# ---- deadlines: one setting each under fault_tolerance.timeouts --------------------------------------------------
STARTUP = "startup"  # start every group and load the models
PLACEMENT = "placement"  # reserve a role's resources (Ray placement groups)
GENERATION_DEADLINE = "generate"  # rollout calls (generate, stream_run)
REWARD_DEADLINE = "reward"  # reward functions and reward models
LOG_PROBS_DEADLINE = "log_probs"  # forward-only passes: log-probs, values
TRAIN_DEADLINE = "train"  # a training step
WEIGHT_SYNC_DEADLINE = "weight_sync"  # loading weights or adapters into the rollout
CHECKPOINT = "checkpoint"  # save or load a checkpoint
DEADLINES = (
    STARTUP,
    PLACEMENT,
    GENERATION_DEADLINE,
    REWARD_DEADLINE,
    LOG_PROBS_DEADLINE,
    TRAIN_DEADLINE,
    WEIGHT_SYNC_DEADLINE,
    CHECKPOINT,
)
# The deadlines whose calls run worker methods (each method says its deadline: `@register(..., deadline=)`), so a
# fault can target them ("step k": the k-th call of such a method on a rank since it started).
# Points inside a call a fault can target too ("step k": the k-th time a rank passes it): a weight-sync bucket
# received from the trainer, a layer bucket loaded into the engine (a sync that fails between buckets).
WEIGHT_SYNC_BUCKET = "weight_sync_bucket"
ENGINE_LOAD_BUCKET = "engine_load_bucket"
FAULT_PHASES = DEADLINES[2:]
FAULT_POINTS = (WEIGHT_SYNC_BUCKET, ENGINE_LOAD_BUCKET)
FAULT_TARGETS = (*FAULT_PHASES, *FAULT_POINTS)  # what `action:role:rank:PHASE:step` may name


# ---- phases of a step: timed (`timing/<phase>`), bounded by a deadline, and with a model, measured in perf/ --------
@dataclass(frozen=True)
class Phase:
    name: str
    role: str  # whose ranks run it
    deadline: str  # the fault_tolerance.timeouts field bounding its group calls
    runs_model: bool = True  # reports perf/<phase>_tflops and _mfu


GENERATE = "generate"
SCORE = "reward"
REFERENCE_LOG_PROBS = "reference"
OLD_LOG_PROBS = "log_probs"
VALUES = "values"
TRAIN = "train"
TEACHER_LOG_PROBS = "teacher"
CRITIC_TRAIN = "critic_train"
WEIGHT_SYNC = "weight_sync"

PHASES: dict[str, Phase] = {
    phase.name: phase
    for phase in (
        Phase(GENERATE, ACTOR_INFER, GENERATION_DEADLINE),
        Phase(SCORE, REWARD, REWARD_DEADLINE, runs_model=False),
        Phase(TEACHER_LOG_PROBS, TEACHER, LOG_PROBS_DEADLINE),
        Phase(REFERENCE_LOG_PROBS, REFERENCE, LOG_PROBS_DEADLINE),
        Phase(OLD_LOG_PROBS, ACTOR_TRAIN, LOG_PROBS_DEADLINE),
        Phase(VALUES, CRITIC, LOG_PROBS_DEADLINE),
        Phase(TRAIN, ACTOR_TRAIN, TRAIN_DEADLINE),
        Phase(CRITIC_TRAIN, CRITIC, TRAIN_DEADLINE),
        Phase(WEIGHT_SYNC, ACTOR_TRAIN, WEIGHT_SYNC_DEADLINE, runs_model=False),
    )
}
MODEL_PHASES = tuple(name for name, phase in PHASES.items() if phase.runs_model)


def deadline_of(name: str) -> str:
    """The timeouts field bounding a phase, or `name` itself when it names a deadline (startup, checkpoint, ...)."""
    if name in PHASES:
        return PHASES[name].deadline
    if name in DEADLINES:
        return name
    raise KeyError(f"{name!r} is neither a phase ({', '.join(PHASES)}) nor a deadline ({', '.join(DEADLINES)})")
