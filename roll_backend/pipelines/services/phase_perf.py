"""Model-FLOPs utilisation of each phase of a step: `perf/<phase>_tflops` and `perf/<phase>_mfu`.

FLOPs come from each role's model config (roll_backend.perf.flops) and the step's real token counts; the peak is
`perf.peak_tflops` per rank from the config (e.g. a GPU's datasheet value) or what each rank measured with a GEMM
probe at start-up in its compute dtype, summed over the role's ranks (a phase runs on all of them at once).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np

from roll_backend import keys, roles
from roll_backend.config.schema import PipelineConfig, RoleConfig, compute_dtype
from roll_backend.distributed.worker import Worker
from roll_backend.perf.flops import ModelFlops
from roll_backend.perf.peak import gemm_shapes
from roll_backend.protocol import DataProto

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SequenceLengths:
    """Real token counts of a batch's rows: prompt, response (up to and including EOS), and the whole sequence."""

    prompt: np.ndarray
    response: np.ndarray
    uid: np.ndarray

    @classmethod
    def of(cls, batch: DataProto) -> SequenceLengths:
        response = batch.batch[keys.RESPONSE_MASK].sum(-1).numpy()
        total = batch.batch[keys.ATTENTION_MASK].sum(-1).numpy()
        uid = batch.non_tensor_batch.get(keys.UID, np.arange(len(batch)))
        return cls(prompt=total - response, response=response, uid=np.asarray(uid))

    @property
    def total(self) -> np.ndarray:
        return self.prompt + self.response


def model_flops_of(role: RoleConfig, value_head: bool = False) -> ModelFlops:
    """The FLOP counter of a role's model (its config.json), with MTP layers and a value head as configured."""
    from transformers import AutoConfig

    counter = ModelFlops.from_hf_config(
        AutoConfig.from_pretrained(role.model_path), mtp_layers=getattr(role.strategy.config, "mtp_num_layers", 0) or 0
    )
    return dataclasses.replace(counter, vocab_size=1) if value_head else counter


class PhasePerf:
    """Per-run FLOP counters and peaks of the roles that run models; turns a step's batch and timings into metrics."""

    def __init__(self, config: PipelineConfig, groups):
        model_roles = {name: getattr(config, name) for name in roles.MODEL_ROLES}
        self.config = config
        self._measured: dict[tuple, list[float]] = {}  # per-rank peaks by what decides them (see _role_peak)
        self.counters = {
            name: model_flops_of(role, value_head=name in (roles.CRITIC, roles.REWARD_MODEL))
            for name, role in model_roles.items()
            if role is not None
        }
        self.peak_tflops = {
            name: self._role_peak(name, role, getattr(groups, name))
            for name, role in model_roles.items()
            if role is not None
        }

    def _role_peak(self, name: str, role: RoleConfig, group) -> float | None:
        """TFLOP/s of all the role's ranks together: configured per rank, or measured by each rank."""
        perf = self.config.perf
        if perf.peak_tflops is not None:
            return perf.peak_tflops * role.world_size
        if not perf.measure_peak:
            return None
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(role.model_path)
        shapes = gemm_shapes(hf_config.hidden_size, hf_config.intermediate_size)
        # CPU ranks share the node's cores: those multiplying the same shapes in the same dtype, as many at once,
        # measure the same, so a role like one measured before (the reference beside a one-rank rollout) takes its
        # numbers.
        # (GPU ranks each measure: roles may sit on different GPU models.)
        key = (compute_dtype(role), tuple(shapes), role.world_size, role.num_cpus_per_rank)
        if role.num_gpus_per_rank or key not in self._measured:
            self._measured[key] = group.call(Worker.measure_gemm_tflops, key[0], shapes, perf.probe_seconds)
        per_rank = self._measured[key]
        peak = float(sum(per_rank))
        logger.info(
            "%s: measured GEMM peak %.3f TFLOP/s over %d ranks (%s)", name, peak, len(per_rank), compute_dtype(role)
        )
        return peak

    def role_of(self, phase: str) -> str:
        """The role whose ranks run `phase` (reference.from_actor_base: the actor's run the reference's)."""
        role = roles.PHASES[phase].role
        if role == roles.REFERENCE and self.config.reference_from_actor_base:
            return roles.ACTOR_TRAIN
        return role

    def step_flops(self, generated: SequenceLengths, batch: DataProto, phases: set[str]) -> dict[str, float]:
        """Model FLOPs of each phase that ran: generation from the sampled batch (before any filtering), the
        others from the batch they processed."""
        lengths = SequenceLengths.of(batch).total
        epochs = self.config.algorithm.ppo_epochs

        def counter(phase: str) -> ModelFlops:
            return self.counters[self.role_of(phase)]

        counts = {
            roles.GENERATE: lambda: counter(roles.GENERATE).generation_flops(
                generated.prompt, generated.response, generated.uid
            ),
            roles.REFERENCE_LOG_PROBS: lambda: counter(roles.REFERENCE_LOG_PROBS).forward_flops(lengths),
            roles.OLD_LOG_PROBS: lambda: counter(roles.OLD_LOG_PROBS).forward_flops(lengths),
            roles.VALUES: lambda: counter(roles.VALUES).forward_flops(lengths),
            roles.TEACHER_LOG_PROBS: lambda: counter(roles.TEACHER_LOG_PROBS).forward_flops(lengths),
            roles.TRAIN: lambda: epochs * counter(roles.TRAIN).train_flops(lengths),
            roles.CRITIC_TRAIN: lambda: epochs * counter(roles.CRITIC_TRAIN).train_flops(lengths),
        }
        return {phase: counts[phase]() for phase in roles.MODEL_PHASES if phase in phases}

    def metrics(self, flops: dict[str, float], seconds: dict[str, float]) -> dict[str, float]:
        out = {}
        for phase, phase_flops in flops.items():
            if seconds.get(phase, 0.0) <= 0:
                continue
            tflops = phase_flops / seconds[phase] / 1e12
            out[f"perf/{phase}_tflops"] = tflops
            peak = self.peak_tflops.get(self.role_of(phase))
            if peak:
                out[f"perf/{phase}_mfu"] = tflops / peak
        return out
