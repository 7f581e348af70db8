"""HF export (strategies/megatron/hf_export.py and MegatronTrainStrategy.export_hf): the shard writer and the
sequence-classifier config on their own; then, on one TP2 x PP2 group, a sharded export that transformers loads with
the same log-probs, written by a rank whose memory grows by about one shard (not the whole model), and a value-head
model exported as Qwen2ForSequenceClassification that transformers and our own loader score as the model does.

Tests run in file order and share the package's TP2 x PP2 group (conftest.py; models are loaded into it with
`init_model_with`).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from megatron_batches import hf_response_log_probs, make_rl_batch_tensors, max_masked_diff
from reconfigurable_workers import ReconfigurableActor

from roll_backend import keys
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_reward_model, tokenizer_for
from roll_backend.protocol import DataProto
from roll_backend.protocol.sequences import at_last_token
from roll_backend.strategies.megatron.config import MegatronTrainConfig
from roll_backend.strategies.megatron.hf_export import (
    INDEX_FILE,
    SINGLE_FILE,
    ShardedSafetensorsWriter,
    sequence_classification_config,
)
from roll_backend.strategies.megatron.hf_files import SCORE_HEAD, score_head_problem
from roll_backend.workers.actor import ActorConfig, ActorWorker
from roll_backend.workers.critic import CriticConfig
from roll_backend.workers.reward_model import with_one_more_column

TOL = 1e-5
# 18 layers of hidden 256: ~68 MiB of float32 weights, 8.5 shards of 8 MiB; its largest tensor (gate_proj, 1 MiB)
# is far below a shard, so a writer holding one shard stays near 8 MiB while one holding the model would not.
LARGE_SPEC = TinyModelSpec(
    hidden_size=256, intermediate_size=1024, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=2
)
MAX_SHARD_BYTES = 8 << 20


# ---- the writer and the config, without Ray ------------------------------------------------------------------------
def _tensors(sizes: list[int]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"t{index}": torch.randn(size, generator=gen) for index, size in enumerate(sizes)}


def _read_folder(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = [folder / SINGLE_FILE] if (folder / SINGLE_FILE).exists() else sorted(folder.glob("model-*.safetensors"))
    out = {}
    for path in files:
        out.update(load_file(str(path)))
    return out


def test_writer_cuts_shards_as_tensors_arrive_and_replaces_an_earlier_export(tmp_path):
    (tmp_path / SINGLE_FILE).write_bytes(b"stale")  # transformers would load this before an index
    (tmp_path / "model-00007-of-00009.safetensors").write_bytes(b"stale")
    tensors = _tensors([10, 10, 10, 80, 10, 5])  # float32: 40, 40, 40, 320, 40, 20 bytes
    writer = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=100)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    written = writer.close()

    names = [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    assert written.files == tuple(names) and written.num_tensors == len(tensors)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names, INDEX_FILE])  # stale and temp files gone
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["weight_map"] == {
        "t0": names[0],
        "t1": names[0],
        "t2": names[1],
        "t3": names[2],  # over the limit: a shard of its own
        "t4": names[3],
        "t5": names[3],
    }
    assert index["metadata"]["total_size"] == written.total_size == sum(t.numel() * 4 for t in tensors.values())
    assert written.peak_held_bytes == 320  # the oversized tensor, alone
    saved = _read_folder(tmp_path)
    assert saved.keys() == tensors.keys() and all(torch.equal(saved[n], t) for n, t in tensors.items())


def test_writer_holds_at_most_one_shard_and_writes_one_file_when_the_model_fits(tmp_path):
    tensors = _tensors([25] * 12)  # 100 bytes each
    writer = ShardedSafetensorsWriter(tmp_path / "sharded", max_shard_bytes=300)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    assert writer.close().peak_held_bytes == 300  # three tensors a shard, never more

    (tmp_path / "single").mkdir()
    (tmp_path / "single" / INDEX_FILE).write_text("{}")  # an earlier sharded export's
    writer = ShardedSafetensorsWriter(tmp_path / "single", max_shard_bytes=10_000)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    assert writer.close().files == (SINGLE_FILE,)
    assert sorted(p.name for p in (tmp_path / "single").iterdir()) == [SINGLE_FILE]
    assert _read_folder(tmp_path / "single").keys() == tensors.keys()


def test_sequence_classification_config_names_the_class_and_takes_the_tokenizers_pad(tmp_path):
    from transformers import LlamaConfig, Qwen2Config

    tokenizer = tokenizer_for(TinyModelSpec(tokenizer="char"))
    tokenizer.save_pretrained(tmp_path)
    causal = Qwen2Config(hidden_size=64, architectures=["Qwen2ForCausalLM"])
    assert causal.pad_token_id is None
    config = sequence_classification_config(causal, tmp_path)
    assert config.architectures == ["Qwen2ForSequenceClassification"] and config.num_labels == 1
    assert config.pad_token_id == tokenizer.pad_token_id is not None
    assert causal.architectures == ["Qwen2ForCausalLM"]  # a copy: the model's own config is untouched
    llama = sequence_classification_config(LlamaConfig(pad_token_id=7), tmp_path / "no_tokenizer")
    assert llama.architectures == ["LlamaForSequenceClassification"] and llama.pad_token_id == 7
    with pytest.raises(ValueError, match="model_type='not_a_model' has no \\*ForSequenceClassification"):
        sequence_classification_config(SimpleNamespace(model_type="not_a_model"), tmp_path)


# ---- one TP2 x PP2 group: sharded export, its memory, a value-head export --------------------------------------------
@pytest.fixture(scope="module")
def group(layout_actors):
    """The package's shared TP2 x PP2 group (conftest.py)."""
    return layout_actors["tp2pp2"]


@pytest.fixture(scope="module")
def large_model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("hf_export_large"), LARGE_SPEC))


@pytest.fixture(scope="module")
def sharded_export(group, large_model_dir, tmp_path_factory) -> dict:
    """The large model loaded into the group and exported in shards of MAX_SHARD_BYTES: {"dir", "ranks": each
    rank's export_hf_measuring_rss}."""
    config = ActorConfig(strategy=MegatronTrainConfig(model_path=large_model_dir, micro_batch_size=2))
    group.call(ReconfigurableActor.init_model_with, config)
    out_dir = tmp_path_factory.mktemp("hf_export_sharded") / "export"
    ranks = group.call(ReconfigurableActor.export_hf_measuring_rss, str(out_dir), MAX_SHARD_BYTES)
    return {"dir": out_dir, "ranks": ranks}


def test_sharded_export_index_holds_every_tensor_once(sharded_export, large_model_dir):
    from safetensors import safe_open

    out_dir, written = sharded_export["dir"], sharded_export["ranks"][0]["written"]
    assert [rank["written"] for rank in sharded_export["ranks"][1:]] == [None, None, None]  # rank 0 writes alone
    index = json.loads((out_dir / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    count = len(files)
    assert count >= 8 and list(written.files) == files
    assert files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert not (out_dir / SINGLE_FILE).exists() and not (out_dir / ".export-shards").exists()
    total, seen = 0, {}
    for name in files:
        with safe_open(str(out_dir / name), framework="pt") as shard:
            shard_bytes = 0
            for tensor_name in shard.keys():
                assert tensor_name not in seen, (tensor_name, seen.get(tensor_name), name)
                seen[tensor_name] = name
                tensor = shard.get_tensor(tensor_name)
                shard_bytes += tensor.numel() * tensor.element_size()
        assert shard_bytes <= MAX_SHARD_BYTES, name
        total += shard_bytes
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == total == written.total_size
    with safe_open(str(Path(large_model_dir) / SINGLE_FILE), framework="pt") as source:
        assert set(seen) == set(source.keys())  # every tensor of the HF model, lm_head included
    assert (out_dir / "config.json").exists() and (out_dir / "tokenizer.json").exists()


def test_sharded_export_loads_in_transformers_with_same_log_probs(group, sharded_export):
    tensors = make_rl_batch_tensors(vocab_size=320, num_rows=5, seed=1)
    expected = group.call(ActorWorker.compute_log_probs, DataProto.from_dict(tensors=tensors)).batch[keys.LOG_PROBS]
    exported, _ = hf_response_log_probs(str(sharded_export["dir"]), tensors)  # AutoModelForCausalLM, float32
    assert max_masked_diff(exported, expected, tensors[keys.RESPONSE_MASK]) < TOL


def test_writer_holds_one_shard_of_a_model_eight_times_larger(sharded_export):
    written = sharded_export["ranks"][0]["written"]
    assert written.total_size >= 8 * MAX_SHARD_BYTES  # holding the whole model would break the bound below
    assert written.peak_held_bytes <= MAX_SHARD_BYTES


def _writer_growth(ranks: list[dict]) -> int:
    """How much more the writing rank's resident memory peaked during an export than its TP peer's: the peer joins
    the same gathers and broadcasts but holds nothing, so the allocator's own growth (several MiB while its arenas
    warm up, on every rank) cancels out."""
    writer = ranks[0]
    peer = next(r for r in ranks[1:] if r["pp"] == writer["pp"])
    return (writer["peak_rss"] - writer["rss_before"]) - (peer["peak_rss"] - peer["rss_before"])


def test_exporting_rank_memory_grows_by_about_one_shard(group, sharded_export, tmp_path):
    """Exporting again (the first export in a process also imports modules and warms the allocator on the writing
    rank alone), the writing process's peak RSS grows less than 3 shards more than its peer's (the shard held, the
    tensor being gathered, allocator slack) for a model 8 shards large; the same export in one shard, which holds the
    whole model, grows more, so the measurement tells the two apart."""
    measure = ReconfigurableActor.export_hf_measuring_rss
    sharded = group.call(measure, str(tmp_path / "sharded"), MAX_SHARD_BYTES)
    if not all(rank["peak_reset"] for rank in sharded):
        pytest.skip("this kernel does not let a process reset its peak RSS (/proc/self/clear_refs)")
    assert _writer_growth(sharded) < 3 * MAX_SHARD_BYTES, _writer_growth(sharded) / 2**20

    whole = group.call(measure, str(tmp_path / "one_shard"), 1 << 40)
    written = whole[0]["written"]
    assert written.files == (SINGLE_FILE,) and written.peak_held_bytes == written.total_size
    assert _writer_growth(whole) > 3 * MAX_SHARD_BYTES, (_writer_growth(whole) / 2**20, _writer_growth(sharded) / 2**20)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2ForSequenceClassification standing in for a trained reward model."""
    return str(build_tiny_reward_model(tmp_path_factory.mktemp("hf_export_rm"), TinyModelSpec(seed=3)))


def _value_model(group, model_dir: str) -> None:
    config = CriticConfig(
        strategy=MegatronTrainConfig(
            model_path=model_dir, micro_batch_size=2, value_head=True, value_head_init="score_head"
        )
    )
    group.call(ReconfigurableActor.init_model_with, config)


def _scores(group, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The value head at each row's last token, as RewardModelWorker.compute_rewards reads it: [B]."""
    batch = with_one_more_column(DataProto.from_dict(tensors=tensors))
    values = group.call(ReconfigurableActor.compute_values, batch).batch[keys.VALUES]  # [B, T_resp + 1]
    return at_last_token(values[:, 1:], tensors[keys.RESPONSE_MASK])


def test_value_head_model_exports_as_sequence_classifier(group, reward_model_dir, tmp_path):
    """A value-head model (here loaded from a reward model's score head) exports as Qwen2ForSequenceClassification
    with its head as `score.weight`: transformers scores it as the model does, and it loads back as a value head.
    Weight sync (iter_hf_weights) still leaves the head out: vLLM serves language models."""
    from safetensors import safe_open
    from transformers import AutoModelForSequenceClassification

    tensors = make_rl_batch_tensors(vocab_size=320, num_rows=4, seed=5)
    _value_model(group, reward_model_dir)
    expected = _scores(group, tensors)
    synced = group.call(ActorWorker.hf_weight_checksums)[0]
    assert SCORE_HEAD not in synced and "lm_head.weight" not in synced

    out_dir = tmp_path / "value_model"
    group.call(ActorWorker.export_hf, str(out_dir))
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert len(config["id2label"]) == 1 and config["pad_token_id"] is not None
    with safe_open(str(out_dir / SINGLE_FILE), framework="pt") as exported:
        assert "lm_head.weight" not in exported.keys()
        assert set(exported.keys()) == set(synced) | {SCORE_HEAD}
        assert tuple(exported.get_tensor(SCORE_HEAD).shape) == (1, 64)

    hf = AutoModelForSequenceClassification.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    with torch.no_grad():  # one unpadded sequence at a time
        got = torch.tensor(
            [
                float(hf(ids[mask.bool()][None]).logits[0, 0])
                for ids, mask in zip(tensors[keys.INPUT_IDS], tensors[keys.ATTENTION_MASK])
            ]
        )
    assert expected.std() > 0.05  # the score head is not ~0: a head left at its init would show
    assert torch.allclose(got, expected, atol=TOL, rtol=0), (got, expected)

    assert score_head_problem(out_dir) is None  # what a RewardModelWorker's config check asks
    _value_model(group, str(out_dir))  # the loader a RewardModelWorker (value_head_init=score_head) runs
    assert torch.allclose(_scores(group, tensors), expected, atol=TOL, rtol=0)
