"""A driver killed with SIGKILL mid-run (issue 15): every process of the run (Ray's, the ranks', the ranks'
children) is gone within 30 s, and `checkpoint.resume=auto` continues with one metrics row per step, repeating the
killed run's last step exactly.

The run trains LoRA adapters (issue #34, configs/grpo_lora_cpu.yaml's settings): the reference is the actor's base
with the adapters off, each weight sync sends the adapters alone to vLLM, which serves them over its base, and the
checkpoint resumed from holds only the adapters and their optimizer state. The resumed run exports the adapters as a
PEFT folder and the merged model; peft on transformers' base gives the merged export's logits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
from pipeline_fixtures import base_config, model_dir, overrides, prompt_file  # noqa: F401  (shared fixtures)
from process_checks import describe, wait_until_gone

from roll_backend.config.loader import load_config
from roll_backend.pipelines import run_with_restarts
from roll_backend.pipelines.tracking import read_metrics


def rows_written(output_dir) -> int:
    path = output_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.is_file() else 0


def test_driver_sigkill_leaves_no_process_and_resume_auto_continues(
    ray_session, base_config, prompt_file, model_dir, tmp_path
):
    args = overrides(
        prompt_file,
        model_dir,
        tmp_path / "run",
        "max_steps=4",
        "checkpoint.save_steps=2",
        "algorithm.ppo_mini_batch_size=16",
        "ray_num_cpus=8",
        *LORA,
        f"checkpoint.export_peft_dir={tmp_path / 'adapter'}",
        f"checkpoint.export_hf_dir={tmp_path / 'merged'}",
    )
    log = (tmp_path / "driver.log").open("w")
    driver = subprocess.Popen(
        [sys.executable, "-m", "roll_backend.cli", "run", str(base_config), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ),
    )
    started = time.monotonic()
    while rows_written(tmp_path / "run") < 3:  # step 3 done: the checkpoint of step 2 is complete
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        assert time.monotonic() - started < 900, "the driver wrote no third step within 15 min"
        time.sleep(0.5)
    killed_run = read_metrics(tmp_path / "run")
    run_pids = [p.pid for p in psutil.Process(driver.pid).children(recursive=True)]
    assert len(run_pids) >= 10  # Ray's own processes, 5 ranks with their watchdogs
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    assert describe(wait_until_gone(run_pids, within_s=30)) == []

    resumed = load_config(base_config, [*args, "checkpoint.resume=auto"])
    history = run_with_restarts(resumed)
    assert [row["step"] for row in history] == [3, 4]
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]  # step 3's first row was cut
    # From the adapter checkpoint of step 2, step 3 is the killed run's step 3.
    (killed_step_3,) = [row for row in killed_run if row["step"] == 3]
    for key in EXACT_KEYS:
        assert history[0][key] == killed_step_3[key], key
    check_lora_run(killed_run + history[1:], resumed)


EXACT_KEYS = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/reference_kl", "weight_sync/logprob_gap")
# The exact-match reward of a random model is all zeros, and GRPO's advantages with it: the entropy bonus moves the
# adapters from the first step (B = 0 gives the KL loss no gradient there).
LORA = (
    "actor_train.strategy.lora={rank: 8, alpha: 16, sync: adapter}",
    "reference.from_actor_base=true",
    "algorithm.entropy_coef=0.01",
)


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
