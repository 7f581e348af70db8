"""Fault injection for recovery tests, off by default: kill, hang or raise in one rank of one role at the k-th
call of a phase's method. Given as `fault_tolerance.inject` in the run config or in the ROLL_BACKEND_INJECT_FAULT
environment variable, both as `action:role:rank:phase:step`, e.g. `kill:actor_train:1:train:3`. Several faults
separated by `;` are one per attempt of a run: the first in the run, the next in the run its first automatic restart
builds, and so on (`remaining_faults`)."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass

from roll_backend import roles

FAULT_ENV = "ROLL_BACKEND_INJECT_FAULT"
FAULTS_OFF = "off"  # passed to a group explicitly: ignore the environment variable too (a restarted run)
# nan: the train call's loss (so its gradient) is NaN; perturb: a weight-sync bucket's first whole tensor arrives
# off by 0.5 (no checksum covers a whole tensor: a silent error only the probe sees)
ACTIONS = ("kill", "hang", "raise", "nan", "perturb")
DATA_ACTIONS = {"nan": roles.TRAIN_DEADLINE, "perturb": roles.WEIGHT_SYNC_BUCKET}  # action -> the phase it acts in
# A fault's phase is a deadline setting whose calls run worker methods (roll_backend.roles.FAULT_PHASES; each method
# says its deadline in @register); "step k" is the k-th call of one of them on that rank since it started (one call
# per step for generate/reward/weight_sync, and for train when a step is one mini-batch).


class InjectedFault(RuntimeError):
    """The `raise` action of fault injection."""


@dataclass(frozen=True)
class FaultSpec:
    action: str
    role: str
    rank: int
    phase: str
    step: int

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """`action:role:rank:phase:step`; raises ValueError saying which part is wrong."""
        parts = text.split(":")
        example = "e.g. kill:actor_train:1:train:3"
        if len(parts) != 5:
            raise ValueError(f"fault injection {text!r} needs 5 parts action:role:rank:phase:step ({example})")
        action, role, rank, phase, step = parts
        if action not in ACTIONS:
            raise ValueError(f"fault injection {text!r}: action {action!r} is not one of {', '.join(ACTIONS)}")
        if phase not in roles.FAULT_TARGETS:
            raise ValueError(
                f"fault injection {text!r}: phase {phase!r} is not one of {', '.join(roles.FAULT_TARGETS)}"
            )
        if action in DATA_ACTIONS and phase != DATA_ACTIONS[action]:
            raise ValueError(
                f"fault injection {text!r}: action {action} changes the data of phase {DATA_ACTIONS[action]}; use it"
            )
        if not (rank.isdigit() and step.isdigit() and int(step) >= 1):
            raise ValueError(f"fault injection {text!r}: rank and step must be whole numbers, step >= 1 ({example})")
        return cls(action, role, int(rank), phase, int(step))


def parse_faults(text: str) -> list[FaultSpec]:
    """The `;`-separated faults of a setting, one per attempt; raises ValueError naming the wrong one."""
    return [FaultSpec.parse(part.strip()) for part in text.split(";")]


def remaining_faults(setting: str | None) -> str:
    """The setting a restarted run gets: the faults after this attempt's, or FAULTS_OFF when none is left (a fault
    that fired does not fire again)."""
    rest = [part.strip() for part in (setting or "").split(";")[1:] if part.strip()]
    return ";".join(rest) if rest and setting != FAULTS_OFF else FAULTS_OFF


def fault_for_rank(setting: str | None, role: str, rank: int) -> FaultSpec | None:
    """The fault this rank must inject in this attempt: the first of `setting` (FAULTS_OFF disables), else of the
    environment."""
    text = os.environ.get(FAULT_ENV) if setting is None else setting
    if not text or text == FAULTS_OFF:
        return None
    spec = parse_faults(text)[0]
    return spec if (spec.role, spec.rank) == (role, rank) else None


class FaultTrigger:
    """Counts a rank's calls of the fault's phase methods and acts at the k-th."""

    def __init__(self, spec: FaultSpec):
        self.spec, self.calls = spec, 0

    def before_call(self, deadline: str | None, rank_tag: str) -> bool:
        """A registered method whose calls run under `deadline` (or a fault point) is about to run on this rank;
        True when this call must change its data (actions nan and perturb)."""
        if deadline != self.spec.phase:
            return False
        self.calls += 1
        if self.calls != self.spec.step:
            return False
        if self.spec.action in DATA_ACTIONS:
            return True
        if self.spec.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.spec.action == "hang":
            threading.Event().wait()  # never set: the rank stops answering, like a stuck collective
        raise InjectedFault(
            f"{rank_tag} injected fault in {self.spec.phase} at call {self.calls} ({FAULT_ENV} / "
            "fault_tolerance.inject)"
        )


def poisoned_loss(loss_fn):
    """`loss_fn` whose loss is NaN (the `nan` fault: a NaN gradient reaches the optimizer)."""

    def poisoned(*args, **kwargs):
        loss, metrics = loss_fn(*args, **kwargs)
        return loss * float("nan"), metrics

    return poisoned


def perturb_whole_tensor(bucket) -> bool:
    """The `perturb` fault on a weight-sync bucket (WeightDeltaBucket): its first whole tensor off by 0.5; False when
    it carries none (the fault then waits for the next bucket)."""
    for delta in bucket.deltas:
        if delta.full is not None:
            delta.full = delta.full + 0.5
            return True
    return False


def perturb_first_tensor(tensors: dict) -> dict:
    """The `perturb` fault on an adapter sync (its one bucket: {name: tensor}): the first tensor off by 0.5."""
    name = next(iter(tensors))
    return tensors | {name: tensors[name] + 0.5}
