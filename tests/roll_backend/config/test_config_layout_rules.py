"""Config errors of parallel layouts (one test per rule, as test_config_errors.py): model-parallel sizes against the
world size and the model's heads, CP / vpp / uneven pipeline splits, vLLM's tensor parallelism and what it refuses."""

from __future__ import annotations

import pytest
from config_fixtures import CONFIG, TINY_HEADS
from test_config_errors import base, problems_of  # noqa: F401  (base: a fixture)

from roll_backend.config.loader import load_config

# (three layers over two pipeline stages: an uneven split)
PP2_OF_3_LAYERS = [
    "actor_train.strategy.tp=1",
    "actor_train.strategy.pp=2",
    "actor_train.world_size=2",
    "build_tiny_model.num_hidden_layers=3",
]


def test_model_parallel_size_must_divide_world_size(base):
    [problem] = problems_of(base + ["actor_train.strategy.tp=2", "actor_train.world_size=3"])
    assert problem == (
        "actor_train: tp*pp*cp = 2*1*1 = 2 does not divide actor_train.world_size=3; "
        "set world_size to a multiple of 2 or shrink the layout"
    )


def test_tp_must_divide_attention_and_kv_heads(base):
    assert problems_of(base + ["actor_train.strategy.tp=3", "actor_train.world_size=3"]) == [
        "actor_train.strategy.tp=3 does not divide num_attention_heads=4; choose one of 1, 2, 4",
        "actor_train.strategy.tp=3 does not divide num_key_value_heads=2; choose one of 1, 2",
    ]


def test_heads_come_from_the_model_folder_when_it_exists(base, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"num_attention_heads": 6, "num_key_value_heads": 6}')
    (model / "tokenizer.json").write_text("{}")
    assert problems_of(
        base + [f"reference.model_path={model}", "reference.strategy.tp=4", "reference.world_size=4"]
    ) == [
        "reference.strategy.tp=4 does not divide num_attention_heads=6; choose one of 1, 2, 3, 6",
        "reference.strategy.tp=4 does not divide num_key_value_heads=6; choose one of 1, 2, 3, 6",
    ]


def test_vllm_tensor_parallelism_has_one_name(base):
    """The engine's TP is the role's `tp`; vLLM's and verl's names for it are refused with that equivalent."""
    for other in ("tensor_parallel_size", "tensor_model_parallel_size"):
        [problem] = problems_of(base + ["actor_infer.strategy.tp=1", f"actor_infer.strategy.{other}=2"])
        assert problem == (
            f"actor_infer.strategy.{other}: unknown key for strategy 'vllm_rollout'; write tp (the role's layout: "
            "one engine per TP group) instead"
        )


def test_cp_vpp_and_uneven_splits_load_for_megatron(base):
    config = load_config(
        CONFIG,
        base
        + [
            "actor_train.strategy.tp=1",
            "actor_train.strategy.cp=2",
            "actor_train.strategy.pp=2",
            "actor_train.strategy.vpp=2",
            "actor_train.world_size=4",
            "build_tiny_model.num_hidden_layers=4",
            "reference.strategy.pp=2",
            "reference.world_size=2",
            "reference.strategy.cp=1",
        ],
    )
    assert config.actor_train.strategy.layout.cp == 2 and config.actor_train.strategy.layout.vpp == 2
    uneven = load_config(CONFIG, base + PP2_OF_3_LAYERS)
    assert uneven.actor_train.strategy.layout.pp == 2


def test_impossible_pipeline_splits_are_refused(base):
    [problem] = problems_of(
        base
        + [
            "actor_train.strategy.tp=1",
            "actor_train.strategy.pp=2",
            "actor_train.strategy.vpp=2",
            "actor_train.world_size=2",
            "build_tiny_model.num_hidden_layers=3",
        ]
    )
    assert problem == (
        "actor_train.strategy (pp=2, vpp=2): num_hidden_layers=3 cannot be split over pp=2 stages with vpp=2: "
        "every stage needs at least 2 layer(s); lower pp or vpp"
    )
    [problem] = problems_of(
        base
        + PP2_OF_3_LAYERS
        + [
            "actor_train.strategy.first_stage_layers=2",
            "actor_train.strategy.last_stage_layers=2",
        ]
    )
    assert problem == (
        "actor_train.strategy (pp=2, vpp=None): first_stage_layers=2 + last_stage_layers=2 = 4 differs "
        "from num_hidden_layers=3 at pp=2"
    )


@pytest.mark.parametrize("setting, shown", [("cp=2", "pp=1, cp=2"), ("pp=2", "pp=2, cp=1")])
def test_cp_and_pp_are_refused_by_vllm(base, setting, shown):
    [problem] = problems_of(base + [f"actor_infer.strategy.{setting}", "actor_infer.world_size=2"])
    assert problem == (
        f"actor_infer.strategy: {shown}, vpp=None: only the Megatron strategies split layers into stages, split "
        "sequences or interleave stages; set pp=1, cp=1 and vpp=null"
    )


@pytest.mark.parametrize("seqs, tokens", [(0, "null"), (65, 64), (-1, 512)])
def test_an_engine_step_runs_one_to_max_num_batched_tokens_sequences(base, seqs, tokens):
    [problem] = problems_of(
        base + [f"actor_infer.strategy.max_num_seqs={seqs}", f"actor_infer.strategy.max_num_batched_tokens={tokens}"]
    )
    assert problem == (
        f"actor_infer.strategy.max_num_seqs={seqs}: an engine step runs 1 to max_num_batched_tokens "
        f"({None if tokens == 'null' else tokens}) "
        "sequences; set it within that (or null for vLLM's default)"
    )
    bound = 1 if tokens == "null" else tokens  # each bound itself loads
    load_config(
        CONFIG,
        base + [f"actor_infer.strategy.max_num_seqs={bound}", f"actor_infer.strategy.max_num_batched_tokens={tokens}"],
    )
