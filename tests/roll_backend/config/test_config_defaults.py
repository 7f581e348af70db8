"""Defaults the loader derives from other settings (the demo config plus overrides, as in test_config_errors)."""

from __future__ import annotations

import pytest
from config_fixtures import CONFIG, TINY_HEADS

from roll_backend.config.loader import load_config
from roll_backend.config.schema import FULL_PRECISION_LOGPROB_GAP, HALF_PRECISION_LOGPROB_GAP


@pytest.mark.parametrize(
    ("overrides", "limit"),
    [
        ([], FULL_PRECISION_LOGPROB_GAP),
        (["actor_train.strategy.params_dtype=bfloat16"], HALF_PRECISION_LOGPROB_GAP),
        (["actor_infer.strategy.dtype=bfloat16"], HALF_PRECISION_LOGPROB_GAP),
        (["actor_train.strategy.params_dtype=bfloat16", "weight_sync_max_logprob_gap=0.5"], 0.5),
    ],
)
def test_weight_sync_probe_limit_follows_the_precision_unless_set(tmp_path, overrides, limit):
    config = load_config(CONFIG, [f"output_dir={tmp_path}/run", *TINY_HEADS, *overrides])
    assert config.logprob_gap_limit() == limit
