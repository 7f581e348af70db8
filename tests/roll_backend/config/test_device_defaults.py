"""Defaults by device: a role with GPUs gets bf16, the distributed optimizer, sequence parallelism and a compiled
engine unless its YAML says otherwise (CPU roles keep float32 and eager); the engine's max_model_len defaults to
prompt + response and a smaller one is refused; colocated roles' GPU shares must fit one GPU. Validated here, not
run."""

from __future__ import annotations

import pytest
from config_fixtures import CONFIG

from roll_backend.config.loader import config_from_dict, load_config, resolve_yaml
from roll_backend.config.typed import ConfigError

GPUS = ["actor_train.num_gpus_per_rank=1", "actor_infer.num_gpus_per_rank=1", "reference.num_gpus_per_rank=1"]


def strategies(config):
    return (config.actor_train.strategy.config, config.actor_infer.strategy.config, config.reference.strategy.config)


def test_roles_with_gpus_get_the_gpu_defaults_and_set_values_win(tmp_path):
    base = [f"output_dir={tmp_path}"]
    train, infer, reference = strategies(load_config(CONFIG, [*base, *GPUS]))
    assert (train.params_dtype, reference.params_dtype, infer.dtype) == ("bfloat16",) * 3
    assert train.optimizer.use_distributed_optimizer and not infer.enforce_eager
    assert train.sequence_parallel and reference.sequence_parallel  # (taken at tp > 1)
    assert train.optimizer.lr == 2.0e-3  # the rest of the YAML's optimizer section kept
    kept = load_config(
        CONFIG,
        [*base, *GPUS, "actor_infer.strategy.enforce_eager=true", "actor_train.strategy.params_dtype=float32"],
    )
    train, infer, _ = strategies(kept)
    assert infer.enforce_eager and train.params_dtype == "float32"
    train, infer, reference = strategies(load_config(CONFIG, base))  # CPU ranks: the CPU defaults
    assert (train.params_dtype, reference.params_dtype, infer.dtype) == ("float32",) * 3
    assert not train.optimizer.use_distributed_optimizer and infer.enforce_eager
    assert train.sequence_parallel is None and reference.sequence_parallel is None  # off on CPU (MoE at tp > 1 aside)


def test_hybrid_roles_on_a_gpu_trainer_get_the_gpu_defaults(tmp_path):
    config = load_config("configs/grpo_hybrid_cpu.yaml", [f"output_dir={tmp_path}", "actor_train.num_gpus_per_rank=1"])
    _, infer, reference = strategies(config)
    assert infer.dtype == "bfloat16" and reference.params_dtype == "bfloat16"


@pytest.mark.parametrize("prompt, response", [(32, 1), (100, 412), (7, 0)])
def test_max_model_len_defaults_to_prompt_plus_response_and_a_smaller_one_is_refused(tmp_path, prompt, response):
    tree = resolve_yaml(
        CONFIG,
        [
            f"output_dir={tmp_path}",
            f"data.max_prompt_length={prompt}",
            f"response_length={response}",
            f"actor_infer.strategy.max_prompt_length={prompt}",
        ],
    )
    del tree["actor_infer"]["strategy"]["max_model_len"]
    if response == 0:
        with pytest.raises(ConfigError):  # response_length must be positive: the typed checks say so
            config_from_dict(tree)
        return
    assert config_from_dict(tree).actor_infer.strategy.config.max_model_len == prompt + response
    tree["actor_infer"]["strategy"]["max_model_len"] = prompt + response - 1  # one token short
    with pytest.raises(ConfigError) as info:
        config_from_dict(tree)
    assert (
        f"actor_infer.strategy.max_model_len={prompt + response - 1} holds fewer tokens than the longest prompt "
        f"({prompt}) plus the response ({response}); set it to at least {prompt + response}"
    ) in str(info.value)


def test_colocated_gpu_shares_must_fit_one_gpu(tmp_path):
    base = [f"output_dir={tmp_path}", "reference.colocate_with=actor_train", "reference.world_size=2"]
    load_config(CONFIG, [*base, "actor_train.num_gpus_per_rank=0.5", "reference.num_gpus_per_rank=0.5"])
    with pytest.raises(ConfigError) as info:
        load_config(CONFIG, [*base, "actor_train.num_gpus_per_rank=1", "reference.num_gpus_per_rank=0.5"])
    assert (
        "roles colocated with actor_train: their GPU shares per rank sum to 1.5 (actor_train 1, reference 0.5); "
        "colocated ranks share one GPU"
    ) in str(info.value)
