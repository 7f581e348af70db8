"""A Megatron rank reads its model's architecture from config.json (HFArch.from_model_path) without importing
transformers when the file is one transformers wrote, and gets AutoConfig's answer for every supported model type,
for files an older transformers wrote, and for hand-written files (which go through AutoConfig)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import transformers
from transformers import AutoConfig

from roll_backend.strategies.megatron.builder import HFArch
from roll_backend.strategies.megatron.config import MOE_MODEL_TYPES, SUPPORTED_MODEL_TYPES

SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
MOE_SIZES = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def _saved(path, model_type: str, **fields) -> str:
    extra = MOE_SIZES if model_type in MOE_MODEL_TYPES else {}
    if model_type == "qwen2_moe":
        extra = {**extra, "shared_expert_intermediate_size": 48}
    AutoConfig.for_model(model_type, vocab_size=301, **SIZES, **extra, **fields).save_pretrained(path)
    return str(path)


def _rewritten(path, change) -> str:
    """The config.json in `path` with `change(fields)` applied."""
    file = path / "config.json"
    fields = json.loads(file.read_text())
    change(fields)
    file.write_text(json.dumps(fields))
    return str(path)


def _from_auto_config(path: str) -> HFArch:
    return HFArch.from_hf_config(AutoConfig.from_pretrained(path))


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_a_file_transformers_wrote_is_read_without_it_as_autoconfig_reads_it(tmp_path, monkeypatch, model_type):
    path = _saved(tmp_path, model_type, tie_word_embeddings=model_type == "qwen3")
    expected = _from_auto_config(path)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", None)  # (read here without it)
    assert HFArch.from_model_path(path) == expected


def _as_transformers_4_wrote_it(fields: dict) -> None:
    """Transformers 4's keys: rope_theta beside rope_scaling, Qwen3-MoE's num_experts."""
    fields["transformers_version"] = "4.51.3"
    fields["rope_theta"] = fields.pop("rope_parameters")["rope_theta"]
    fields["rope_scaling"] = None
    if "num_local_experts" in fields:
        fields["num_experts"] = fields.pop("num_local_experts")


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3_moe"])
def test_an_older_transformers_file_and_a_hand_written_one_give_autoconfigs_answer(tmp_path, model_type):
    _saved(tmp_path, model_type, rope_theta=5e5)
    old = _rewritten(tmp_path, _as_transformers_4_wrote_it)
    assert HFArch.from_model_path(old) == _from_auto_config(old)
    assert HFArch.from_model_path(old).rope_theta == 5e5
    # written by hand: no head_dim, whose Qwen3 default (128) is not hidden_size / heads, and no transformers_version
    hand = tmp_path / "hand"
    _saved(hand, "qwen3")
    _rewritten(hand, lambda fields: [fields.pop(key) for key in ("head_dim", "transformers_version")])
    assert HFArch.from_model_path(str(hand)) == _from_auto_config(str(hand))
    assert HFArch.from_model_path(str(hand)).head_dim == AutoConfig.for_model("qwen3").head_dim


def test_a_scaled_rope_in_an_older_file_is_refused_as_through_autoconfig(tmp_path):
    def yarn(fields):
        _as_transformers_4_wrote_it(fields)
        fields["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}

    _saved(tmp_path, "qwen2")
    path = _rewritten(tmp_path, yarn)
    for read in (HFArch.from_model_path, _from_auto_config):
        with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
            read(path)


def test_a_rank_reading_its_model_never_imports_transformers(tmp_path):
    path = _saved(tmp_path, "qwen3_moe")
    code = (
        "import sys; from roll_backend.strategies.megatron.builder import HFArch; "
        f"HFArch.from_model_path({path!r}); print('transformers' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
