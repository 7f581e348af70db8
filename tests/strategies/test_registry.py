"""The strategy registry: the one list of names, lazy imports, typed configs."""

from __future__ import annotations

import pytest

from roll_backend.strategies.megatron.config import MegatronInferConfig, MegatronTrainConfig
from roll_backend.strategies.registry import STRATEGIES, UnknownStrategyError, config_class, strategy_class


def test_unknown_name_lists_known_ones():
    with pytest.raises(
        UnknownStrategyError, match="unknown strategy 'megatron' for actor; known: .*megatron_infer, megatron_train"
    ):
        strategy_class("megatron", role="actor")


def test_megatron_entries_resolve_to_classes_and_configs():
    assert {"megatron_train", "megatron_infer"} <= set(STRATEGIES)
    assert strategy_class("megatron_train").config_class is config_class("megatron_train") is MegatronTrainConfig
    assert strategy_class("megatron_infer").config_class is config_class("megatron_infer") is MegatronInferConfig


def test_configs_report_every_problem_at_once():
    with pytest.raises(ValueError, match="micro_batch_size=0.*temperature=0"):
        MegatronInferConfig(model_path="x", micro_batch_size=0, temperature=0)
