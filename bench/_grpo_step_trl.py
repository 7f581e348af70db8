"""The TRL side of bench/grpo_step.py: GRPOTrainer on CPU (transformers generate), one optimizer step per
generation batch, in the dtype bench/grpo_step.py chose (bench/_machine.py: bf16 only where the CPU has it natively).

bench/grpo_step.py runs it as its own process (`python bench/_grpo_step_trl.py REQUEST_JSON`), started with the
same allocator settings roll-backend gives its CPU ranks, so neither side gains from the process it runs in.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

RESULT_PREFIX = "TRL_STEP_SECONDS "
PHASES_PREFIX = "TRL_PHASE_SECONDS "


class PhaseClock:
    """Wall time spent inside some of the trainer's methods, per optimizer step: GRPOTrainer's `_generate` is
    generation, `_generate_and_score_completions` adds rewards and the reference forward, the rest of the step
    is the policy's forward and backward."""

    def __init__(self, trainer, names: tuple[str, ...]):
        self.totals = {name: 0.0 for name in names}
        for name in names:
            setattr(trainer, name, self._timed(name, getattr(trainer, name)))

    def _timed(self, name, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - start

        return timed

    def take(self) -> dict[str, float]:
        taken, self.totals = self.totals, {name: 0.0 for name in self.totals}
        return taken


def grpo_config(scale, work_dir: Path, steps: int, dtype: str):
    """GRPOTrainer's settings matching roll-backend's side: one optimizer step per generation batch, exactly
    `scale.new_tokens` new tokens, KL 0.04, no vLLM, bf16 mixed precision only when `dtype` is bfloat16."""
    from trl import GRPOConfig

    completions = scale.prompts * scale.samples
    return GRPOConfig(
        output_dir=str(work_dir),
        use_cpu=True,
        bf16=dtype == "bfloat16",
        seed=0,
        max_steps=1 + steps,
        learning_rate=1e-6,
        # One generation batch (prompts x samples) per optimizer step, in micro-batches of scale.micro_batch.
        per_device_train_batch_size=scale.micro_batch,
        gradient_accumulation_steps=completions // scale.micro_batch,
        num_generations=scale.samples,
        num_iterations=1,
        max_completion_length=scale.new_tokens,
        generation_kwargs={"min_new_tokens": scale.new_tokens},  # exactly new_tokens: EOS suppressed until then
        temperature=1.0,
        beta=0.04,
        use_vllm=False,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def trl_step_seconds(
    model_dir: str, rows: list[dict], scale, work_dir: Path, steps: int, dtype: str
) -> tuple[list[float], list[dict]]:
    """Run 1 warm-up + `steps` GRPO steps; returns each timed step's wall seconds (generation included) and its
    phases (generate, reference: the reference forward and rewards, train)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from roll_backend.rewards.exact_match import score

    def exact_match_reward(completions, answer, **_):  # the rule the roll-backend side's reward worker runs
        return [score(completion[0]["content"], ref) for completion, ref in zip(completions, answer)]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends = [time.perf_counter()]
            self.phases: list[dict[str, float]] = []
            self.inside: PhaseClock | None = None

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())
            inside = self.inside.take()
            scored = inside["_generate_and_score_completions"]
            self.phases.append(
                {
                    "generate": inside["_generate"],
                    "reference": scored - inside["_generate"],
                    "train": self.ends[-1] - self.ends[-2] - scored,
                }
            )

    args = grpo_config(scale, work_dir, steps, dtype)
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    )
    import torch

    print(
        f"TRL: {torch.get_num_threads()} torch threads, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True
    )
    clock = StepClock()
    trainer = GRPOTrainer(
        model=model_dir, reward_funcs=exact_match_reward, args=args, train_dataset=dataset, callbacks=[clock]
    )
    clock.inside = PhaseClock(trainer, ("_generate", "_generate_and_score_completions"))
    clock.ends = [time.perf_counter()]
    trainer.train()
    durations = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    return durations[1:], clock.phases[1:]  # drop the warm-up step


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    seconds, phases = trl_step_seconds(
        request["model_dir"],
        request["rows"],
        SimpleNamespace(**request["scale"]),
        Path(request["work_dir"]),
        request["steps"],
        request["dtype"],
    )
    print(PHASES_PREFIX + json.dumps(phases), flush=True)
    print(RESULT_PREFIX + json.dumps(seconds), flush=True)
