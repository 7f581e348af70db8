"""A driver killed with SIGKILL mid-run (issue 15) at a moment drawn from ROLL_BACKEND_PROPERTY_SEED (issue #52):
after a drawn step's row, a drawn fraction of a second later, so it lands in a step's rollout, update, weight sync
or checkpoint write. Every process of the run (Ray's, the ranks', the ranks' children) is gone within 30 s, and
`checkpoint.resume=auto` continues from the newest complete checkpoint with one metrics row per step, repeating the
killed run's step after that checkpoint exactly, and the ledger shows every prompt trained once.

The run is the LoRA demo (configs/grpo_lora_cpu.yaml, issue #34) on the hybrid engine (the vLLM engine at TP2 in the
actor's two processes): rank-8 adapters on the frozen tiny model, the reference the actor's base with the adapters
off, each weight sync handing the adapters alone to vLLM in the process, which serves them over its base,
checkpoints holding only the adapters and their optimizer state. It learns the task (mean reward
>= 0.8 over its last steps) across the kill. The resumed run exports the adapters as a PEFT folder and the merged
model; peft on transformers' base gives the merged export's logits.

The same kill lands in an asynchronous run with dynamic sampling (one-step off-policy, and streaming), whose resume
must account for the prompts that were in flight or filtered when the driver died (the ledger)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from pipeline_fixtures import assert_every_prompt_trained_once
from process_checks import describe, wait_until_gone
from test_streaming import SHAPE, STREAMING, assert_ledger_accounts_for_every_position, rare_reward

from roll_backend.config.loader import load_config
from roll_backend.pipelines import run_with_restarts
from roll_backend.pipelines.services.checkpoint import newest_complete_checkpoint
from roll_backend.pipelines.services.tracking import read_metrics


def rows_written(output_dir) -> int:
    path = output_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.is_file() else 0


STEPS = 30
SEED = int(os.environ.get("ROLL_BACKEND_PROPERTY_SEED", "2811"))
# The kill: KILL_AFTER rows written, then up to a step's length later (checkpoints every 3 steps); drawn so that
# other seeds land elsewhere, before any checkpoint included.
_draw = random.Random(SEED)
KILL_AFTER, KILL_DELAY_S = _draw.randint(1, STEPS - 4), _draw.uniform(0.0, 1.5)  # (4 steps left to land in)
WINDOW = 3  # steps the reward is averaged over at the end
CONFIG = str(Path(__file__).resolve().parents[3] / "configs" / "grpo_lora_cpu.yaml")
RANKS = 3  # actor_train 2 hosting actor_infer (the hybrid engine), reward 1 (the reference is the actor's base)
DEMO_CONFIG = str(Path(__file__).resolve().parents[3] / "configs" / "grpo_tiny_cpu.yaml")
# mode -> (the rare reward's modulus: how often a group's responses differ, its settings)
ASYNC_MODES = {
    "one_step": (3, ("async_generation.enabled=true",)),
    "streaming": (10, (*STREAMING, "async_generation.max_staleness=1", "algorithm.max_generation_rounds=8")),
}
HYBRID = ("actor_infer.hybrid=true", "actor_infer.world_size=2", "actor_infer.strategy.tp=2")


def test_driver_sigkill_leaves_no_process_and_resume_auto_continues(ray_session, tmp_path):
    args = [
        f"output_dir={tmp_path / 'run'}",
        f"max_steps={STEPS}",
        "checkpoint.save_steps=3",
        "ray_num_cpus=8",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "perf.measure_peak=false",
        f"checkpoint.export_peft_dir={tmp_path / 'adapter'}",
        f"checkpoint.export_hf_dir={tmp_path / 'merged'}",
        *HYBRID,
    ]
    killed_run, moment, resumed_after = run_and_kill_driver(CONFIG, args, tmp_path, KILL_AFTER, KILL_DELAY_S, RANKS)

    resumed = load_config(CONFIG, [*args, "checkpoint.resume=auto"])
    history = run_with_restarts(resumed)
    assert [row["step"] for row in history] == list(range(resumed_after + 1, STEPS + 1)), moment
    steps = [row["step"] for row in read_metrics(tmp_path / "run")]
    assert steps == list(range(1, STEPS + 1)), moment  # the killed run's rows of the steps redone were cut
    assert_every_prompt_trained_once(tmp_path / "run", STEPS, resumed.rollout_batch_size)
    # From the newest complete (adapter) checkpoint, the next step is the killed run's, where it got that far.
    for killed_step in [row for row in killed_run if row["step"] == resumed_after + 1]:
        for key in EXACT_KEYS:
            assert history[0][key] == killed_step[key], (key, moment)
    whole_run = [row for row in killed_run if row["step"] <= resumed_after] + history
    rewards = [row["reward/mean"] for row in whole_run]
    assert sum(rewards[-WINDOW:]) / WINDOW >= 0.8, f"mean reward per step: {[round(r, 2) for r in rewards]}"
    check_lora_run(whole_run, resumed)


def run_and_kill_driver(config: str, args: list[str], tmp_path, kill_after: int, delay_s: float, ranks: int):
    """Start `roll-backend run config args` as its own driver (its own Ray), SIGKILL it `delay_s` after its row
    `kill_after`, and check every process of the run is gone within 30 s. Returns the rows it wrote, the moment, and
    the step of the newest complete checkpoint a resume continues after (0: none)."""
    run_dir = tmp_path / "run"
    log = (tmp_path / "driver.log").open("w")
    driver = subprocess.Popen(
        [sys.executable, "-m", "roll_backend.cli", "run", config, *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ),
    )
    started = time.monotonic()
    while rows_written(run_dir) < kill_after:
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        assert time.monotonic() - started < 900, f"the driver wrote no step {kill_after} within 15 min"
        time.sleep(0.2)
    run_pids = [p.pid for p in psutil.Process(driver.pid).children(recursive=True)]
    assert len(run_pids) >= 2 * ranks + 2  # the ranks with their watchdogs, Ray's GCS and raylet at least
    time.sleep(delay_s)  # (not a synchronisation: where in the next step the kill lands)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    killed_run = read_metrics(run_dir)
    moment = f"seed {SEED}: killed {delay_s:.2f} s after row {kill_after}, with {len(killed_run)} rows written"
    assert driver.returncode == -signal.SIGKILL, f"the run ended before the kill: {moment}"  # (no vacuous pass)
    assert describe(wait_until_gone(run_pids, within_s=30)) == [], moment
    newest, _ = newest_complete_checkpoint(run_dir)
    resumed_after = 0 if newest is None else int(newest.name.removeprefix("step_"))
    assert resumed_after <= len(killed_run), moment
    return killed_run, moment, resumed_after


# An asynchronous run (one-step off-policy, or streaming with max_staleness 1) with dynamic sampling, killed after a
# drawn row (1-3) and delay: 10 steps of the demo task's small shape (test_streaming.py; ~0.3 s a step here, so the
# 7 steps after the latest kill outlast its delay and polling on a faster machine too), a checkpoint every 2 steps.
ASYNC_STEPS = 10
_async_draw = random.Random(f"{SEED}-async")
ASYNC_KILLS = {mode: (_async_draw.randint(1, 3), _async_draw.uniform(0.0, 1.0)) for mode in ASYNC_MODES}


@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_an_async_run_with_dynamic_sampling_resumes_after_a_driver_sigkill_with_every_prompt_accounted_for(
    ray_session, tmp_path, mode
):
    """What test_streaming.py's rank kills check, after the driver's death instead: the resumed run (in this process)
    continues from the newest complete checkpoint, one metrics row per step, and its ledger has every position the
    killed and the resumed run admitted trained once, filtered or accounted for (one-step: exactly the ten steps'
    batches settled)."""
    kill_after, delay_s = ASYNC_KILLS[mode]
    modulus, mode_settings = ASYNC_MODES[mode]
    args = [
        f"output_dir={tmp_path / 'run'}",
        *SHAPE,
        "actor_infer.world_size=1",  # three fresh ranks to start, not five: one engine, no reference
        "reference=null",
        "algorithm.use_kl_loss=false",
        f"max_steps={ASYNC_STEPS}",
        "algorithm.dynamic_sampling=true",
        "checkpoint.save_steps=2",
        "logging.tensorboard=false",
        "ray_num_cpus=8",
        *mode_settings,
        *rare_reward(tmp_path, modulus),
    ]
    config = load_config(DEMO_CONFIG, args)
    ranks = config.actor_train.world_size + config.actor_infer.world_size + config.reward.world_size
    _, moment, resumed_after = run_and_kill_driver(DEMO_CONFIG, args, tmp_path, kill_after, delay_s, ranks)

    history = run_with_restarts(load_config(DEMO_CONFIG, [*args, "checkpoint.resume=auto"]))
    assert [row["step"] for row in history] == list(range(resumed_after + 1, ASYNC_STEPS + 1)), moment
    rows = read_metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == list(range(1, ASYNC_STEPS + 1)), moment
    events = assert_ledger_accounts_for_every_position(tmp_path / "run", rows, moment)
    if mode == "one_step":  # every batch of the ten steps settled, none beyond them
        size = config.rollout_batch_size
        settled = {p for _, event, p in events if event in ("trained", "filtered")}
        assert sorted(settled) == list(range(size, (ASYNC_STEPS + 1) * size)), (moment, sorted(settled))


EXACT_KEYS = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/reference_kl", "weight_sync/logprob_gap")


def check_lora_run(history: list[dict], config) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    first = history[0]
    # Step 1: the adapters start at B = 0, so the reference (the base, adapters off) is the model that sampled.
    assert first["reference/rollout_logprob_gap"] < 1e-5 and abs(first["actor/reference_kl"]) < 1e-6, first
    assert history[-1]["actor/reference_kl"] > 1e-4  # then the adapters move the policy away from it
    model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=torch.float32)
    spec, rank = model.config, config.actor_train.strategy.config.lora.rank
    head_dim = spec.hidden_size // spec.num_attention_heads
    kv = spec.num_key_value_heads * head_dim
    q_o, ffn = 2 * spec.hidden_size, spec.hidden_size + spec.intermediate_size
    widths = 2 * q_o + 2 * (spec.hidden_size + kv) + 3 * ffn  # in + out of q, o; k, v; gate, up, down
    for row in history:
        assert row["weight_sync/logprob_gap"] < 1e-4, row  # vLLM's adapter over its base scores as the actor does
        assert row["weight_sync/tensors"] == spec.num_hidden_layers * 7 * 2  # only the adapters travel
        assert row["weight_sync/bytes"] == spec.num_hidden_layers * rank * widths * 4, row
    merged = AutoModelForCausalLM.from_pretrained(config.checkpoint.export_hf_dir, dtype=torch.float32).eval()
    adapted = PeftModel.from_pretrained(model, config.checkpoint.export_peft_dir).eval()
    tokens = torch.randint(0, spec.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = merged(tokens).logits, adapted(tokens).logits
        with adapted.disable_adapter():
            plain = adapted(tokens).logits
    assert (got - want).abs().max() < 1e-4
    assert (plain - want).abs().max() > 1e-3  # the adapters change the model
