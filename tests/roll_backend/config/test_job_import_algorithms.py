"""`roll-backend convert` on what a job trains with: verl's policy-loss modes and estimators, ROLL's PPO critic."""

from __future__ import annotations

import pytest
from test_job_import import MODEL, ROLL_CONFIG, VERL_SCRIPT, prompt_files  # noqa: F401  (prompt_files: a fixture)

from roll_backend import cli
from roll_backend.config.loader import load_config


@pytest.mark.parametrize(
    "loss_mode, estimator, ours",
    [
        ("vanilla", "grpo", "ppo"),
        ("gspo", "grpo", "gspo"),
        ("cispo", "grpo", "cispo"),
        ("sapo", "grpo", "sapo"),
        ("geo_mean", "grpo", "geo_mean"),
        ("gpg", "gpg", "gpg"),
    ],
)
def test_verl_s_loss_mode_and_estimators_carry_over(tmp_path, prompt_files, loss_mode, estimator, ours):
    """verl's `policy_loss.loss_mode` picks the policy loss (a GSPO or CISPO job used to train with PPO's clip, the
    key reported as unknown), with SAPO's gate temperatures; its gpg estimator carries over too."""
    script = tmp_path / f"run_{loss_mode}.sh"
    extra = f"    actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode} \\\\\n"
    extra += "    actor_rollout_ref.actor.tau_pos=1.2 \\\\\n    actor_rollout_ref.actor.tau_neg=1.4 \\\\\n"
    text = VERL_SCRIPT.format(train=prompt_files[0], model=MODEL).replace("algorithm.adv_estimator=grpo \\\n", "")
    text = text.replace(
        "    data.train_files=", f"    algorithm.adv_estimator={estimator} \\\n{extra}    data.train_files="
    )
    script.write_text(text)
    out = tmp_path / "converted.yaml"
    assert cli.main(["convert", "verl", str(script), "-o", str(out)]) == 0
    algo = load_config(out, [], recipe_check=True).algorithm
    assert (algo.policy_loss, algo.adv_estimator, algo.sapo_tau_pos, algo.sapo_tau_neg) == (ours, estimator, 1.2, 1.4)


ROLL_CRITIC = """
critic:
  model_args: {{dtype: bf16, model_type: trl}}
  training_args: {{learning_rate: 2.0e-6, weight_decay: 0.01, per_device_train_batch_size: 2,
                  gradient_accumulation_steps: 32, warmup_steps: 5}}
  strategy_args:
    strategy_name: megatron_train
    strategy_config: {{tensor_model_parallel_size: 2}}
  device_mapping: list(range(0,8))
  infer_batch_size: 4
"""


def test_a_roll_ppo_job_gets_its_critic_on_the_actor_s_model_with_its_own_optimizer(tmp_path, prompt_files):
    """ROLL's PPO (adv_estimator: gae with a `critic:` section that names no model) is a ppo run whose critic starts
    from the run's model with the critic's learning rate, weight decay, warm-up and micro-batch (its accumulation is
    the actor's mini-batch here, reported)."""
    source = tmp_path / "ppo_config.yaml"
    text = ROLL_CONFIG.format(model=MODEL, train=prompt_files[0], val=prompt_files[1]) + ROLL_CRITIC.format()
    source.write_text(text.replace("adv_estimator: grpo", "adv_estimator: gae"))
    out = tmp_path / "ppo.yaml"
    assert cli.main(["convert", "roll", str(source), "-o", str(out)]) == 0
    config = load_config(out, [], recipe_check=True)
    critic = config.critic.strategy.config
    assert config.pipeline == "ppo" and config.critic.model_path == config.model_path and not config.critic.hybrid
    assert (critic.optimizer.lr, critic.optimizer.weight_decay, critic.lr_schedule.warmup_steps) == (2e-6, 0.01, 5)
    assert critic.micro_batch_size == 2 and config.critic.strategy.layout.tp == 2
    report = (tmp_path / "ppo.report.txt").read_text()
    assert (
        "critic.training_args.gradient_accumulation_steps = 32: the critic steps on the actor's mini-batches" in report
    )
