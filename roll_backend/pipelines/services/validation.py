"""Validation during training: the `data.val_path` prompts generated with the `eval` settings, scored by the run's
reward, reported as `val/<source>/...` metrics (mean@n, pass@k, maj@k, response length; algorithms.eval_metrics),
with every sample written to output_dir/validation.jsonl. It never trains, and each generation is seeded on its own,
so the training data order and sampling are the same as without it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from roll_backend import keys, roles
from roll_backend.algorithms.eval_metrics import validation_metrics
from roll_backend.config.schema import PipelineConfig
from roll_backend.pipelines.groups import RoleGroups
from roll_backend.pipelines.loops import phases
from roll_backend.pipelines.services.tracking import PhaseTimer
from roll_backend.protocol import DataProto
from roll_backend.rewards.exact_match import extract_final_answer, normalize
from roll_backend.workers.rollout import RolloutWorker

SAMPLES_FILE = "validation.jsonl"
VALIDATION_SEED_SALT = 3  # phases.step_seed salt: validation samples apart from the training rollouts


def validation_due(config: PipelineConfig, step: int) -> bool:
    """Validation runs after the last step and every eval.every_steps steps (and before training: the driver)."""
    every = config.eval.every_steps
    return step == config.max_steps or bool(every and step % every == 0)


class Validation:
    """Runs validation for a PipelineRun at the steps the `eval` block asks for."""

    def __init__(self, config: PipelineConfig, prompts: DataProto, output_dir: Path, first_step: int):
        self.config, self.prompts = config, prompts
        self.samples_path = Path(output_dir) / SAMPLES_FILE
        _cut_samples_after(self.samples_path, first_step - 1)

    def due(self, step: int) -> bool:
        return validation_due(self.config, step)

    def sampling(self, step: int) -> dict:
        """The rollout's per-call settings (strategies/vllm: META_VALIDATE picks its validation sampling)."""
        ev = self.config.eval
        meta = {keys.META_VALIDATE: True, "n": ev.n, keys.META_SAMPLING_SEED: self._seed(step)}
        temperature = ev.temperature
        if temperature is None and ev.n > 1:
            temperature = self.config.actor_infer.strategy.config.sampling.temperature
        if temperature is not None:
            meta["temperature"] = temperature
        if ev.top_p is not None:
            meta["top_p"] = ev.top_p
        return meta

    def _seed(self, step: int) -> int:
        return phases.step_seed(self.config, step, salt=VALIDATION_SEED_SALT)

    def run(self, groups: RoleGroups, step: int) -> dict[str, float]:
        """Generate, score and report; `val/...` metrics and `timing/validate`."""
        ev = self.config.eval
        timer = PhaseTimer(self.config.fault_tolerance.timeouts)  # each call within its phase's deadline
        started = time.perf_counter()
        scored, rollout = [], []
        for start in range(0, len(self.prompts), ev.prompts_per_call):
            chunk = self.prompts.select_idxs(list(range(start, min(start + ev.prompts_per_call, len(self.prompts)))))
            chunk.meta_info = self.sampling(step)
            with timer.phase(roles.GENERATE):
                generated = groups.actor_infer.call(RolloutWorker.generate, chunk)
            rollout.append(phases.generation_metrics(generated))
            with timer.phase(roles.SCORE):
                generated.meta_info[keys.META_VALIDATE] = True  # (scored without reward shaping: workers/reward.py)
                phases.score(groups, generated, self.config.reward)
            scored.append(generated)
        batch = DataProto.concat(scored)
        rewards = batch.batch[keys.TOKEN_LEVEL_SCORES].sum(-1).tolist()
        lengths = batch.batch[keys.RESPONSE_MASK].sum(-1).tolist()
        texts = [str(t) for t in batch.non_tensor_batch[keys.RESPONSE_TEXT]]
        metrics = validation_metrics(
            batch.non_tensor_batch[keys.UID],
            batch.non_tensor_batch[keys.DATA_SOURCE],
            rewards,
            [normalize(extract_final_answer(text)) for text in texts],
            lengths,
            ev.pass_k,
            ev.maj_k,
            ev.correct_threshold,
        )
        self._write_samples(step, batch, texts, rewards)
        # Multi-turn rollouts: success rate, turns, tool calls... of the validation trajectories (val/agentic/...).
        agentic = {
            f"val/{name}": float(np.mean([m[name] for m in rollout])) for name in rollout[0] if "agentic/" in name
        }
        return metrics | agentic | {"timing/validate": time.perf_counter() - started}

    def _write_samples(self, step: int, batch: DataProto, texts: list[str], rewards: list[float]) -> None:
        columns = batch.non_tensor_batch
        with self.samples_path.open("a") as out:
            for i, (text, reward) in enumerate(zip(texts, rewards)):
                row = {
                    "step": step,
                    "data_source": str(columns[keys.DATA_SOURCE][i]),
                    "prompt": _jsonable(columns[keys.PROMPT_TEXT][i]),
                    "response": text,
                    "answer": columns[keys.ANSWER][i],  # as the data stored it (None: no answer)
                    "reward": reward,
                }
                out.write(json.dumps(row, default=str) + "\n")


def _jsonable(prompt):
    return [dict(message) for message in prompt] if isinstance(prompt, (list, tuple)) else str(prompt)


def _cut_samples_after(path: Path, step: int) -> None:
    """Drop sample rows of steps after `step` (a resumed run validates those steps again)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))
