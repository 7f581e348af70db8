"""Fixtures shared by the pipeline tests: a prompt file, a tiny model, the demo config with an exact-match reward,
and the overrides that shrink a run to a few seconds per step."""

from __future__ import annotations

import json

import pytest

PROMPTS = [{"prompt": f"copy: {d}", "answer": str(d)} for d in range(10)]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("model") / "tiny", TinyModelSpec(hidden_size=128, intermediate_size=256, seed=3)
    )  # vLLM CPU attention needs head_dim >= 32


@pytest.fixture(scope="module")
def base_config(tmp_path_factory):
    """The demo config with an exact-match reward (dict overrides merge into, not replace, the demo's rewards)."""
    from omegaconf import OmegaConf

    tree = OmegaConf.load("configs/grpo_tiny_cpu.yaml")
    tree.reward.rewards = {"exact_match": 1.0}
    path = tmp_path_factory.mktemp("config") / "pipeline.yaml"
    OmegaConf.save(tree, path)
    return path


def overrides(prompt_file, model_dir, output_dir, *extra: str) -> list[str]:
    return [
        f"output_dir={output_dir}",
        f"model_path={model_dir}",
        "build_tiny_model=null",
        f"data.train_path={prompt_file}",
        "data.synthetic=null",
        "rollout_batch_size=4",
        "num_return_sequences_in_group=4",
        "response_length=6",
        "algorithm.ppo_mini_batch_size=8",
        "actor_train.strategy.micro_batch_size=4",
        "reference.strategy.micro_batch_size=8",
        "logging.progress_bar=false",
        "perf.measure_peak=false",  # the start-up GEMM probe: test_recovery's uninterrupted run measures it
        *extra,
    ]


def same_numbers(row: dict) -> dict:
    """A step's metrics without wall times, rates, memory, the engine's cache state, restart counters and the weight
    sync's transport (a hybrid sync moves nothing between processes; a minimal one sends what changed): the numbers
    two runs of the same steps share wherever their roles run."""
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(
            ("timing/", "throughput/", "perf/", "fault_tolerance/", "rollout/", "memory/", "weight_sync/")
        )
        and not k.endswith(("_seconds", "_per_s", "_s", "busy_fraction"))
    }


def hybrid_roles(world_size: int, tp: int) -> tuple[str, ...]:
    """The rollout and the reference on the hybrid engine (in actor_train's `world_size` processes at TP `tp`, as
    configs/grpo_hybrid_cpu.yaml places them), every part of every model offloaded while idle."""
    return (
        "actor_infer.hybrid=true",
        f"actor_infer.world_size={world_size}",
        f"actor_infer.strategy.tp={tp}",
        "reference.hybrid=true",
        f"reference.world_size={world_size}",
        f"reference.strategy.tp={tp}",
        "reference.strategy.offload_params=true",
        "actor_train.strategy.offload_params=true",
        "actor_train.strategy.offload_grads=true",
        "actor_train.strategy.offload_optimizer=true",
    )


def assert_every_prompt_trained_once(output_dir, steps: int, batch_size: int, in_order: bool = True) -> None:
    """The run's prompt ledger (issue #52) after its kills and resumes: `roll-backend ledger` finds no problem, and
    steps x batch_size distinct positions were each trained once (`in_order`: exactly the stream's positions of
    steps 1..steps, as a synchronous or one-step run trains them)."""
    from pathlib import Path

    from roll_backend.pipelines.services.ledger import LEDGER_FILE, read_events, report

    summary, problems = report(output_dir)
    assert problems == [], (summary, problems[:5])
    trained = [p for _, event, p in read_events(Path(output_dir) / LEDGER_FILE) if event == "trained"]
    assert len(trained) == len(set(trained)) == steps * batch_size, summary
    if in_order:
        assert sorted(trained) == list(range(batch_size, (steps + 1) * batch_size)), summary
