"""PromptMixture: several prompt files drawn by weight, deterministic per (seed, step), each file read epoch by
epoch; the per-source metrics; the data.train_path list in the config; one file exactly as before."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from roll_backend import cli, keys
from roll_backend.config.loader import config_to_yaml, load_config
from roll_backend.config.schema import DataConfig, TrainSource
from roll_backend.config.typed import ConfigError
from roll_backend.models.tiny import build_char_tokenizer
from roll_backend.pipelines.data.mixture import (
    PromptMixture,
    StreamSplit,
    per_source_prompt_metrics,
    per_source_reward_metrics,
)
from roll_backend.pipelines.data.prompt_dataset import PromptDataset
from roll_backend.pipelines.data.prompts import check_data, training_prompts
from roll_backend.pipelines.data.rows import DataError
from roll_backend.protocol import DataProto

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "grpo_tiny_cpu.yaml"  # char tokenizer "0123456789 copy"


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer("0123456789 abcdefghijklmnopqrstuvwxyz")  # one token per character


def write_prompts(path: Path, count: int, tag: str, **columns) -> str:
    """`count` rows whose answer `tag-i` says which file and row it is."""
    rows = [{"prompt": f"copy {i}", "answer": f"{tag}-{i}", **columns} for i in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def mixture(tmp_path, sizes_weights: list[tuple[int, float]], seed: int = 0) -> PromptMixture:
    entries = tuple(
        TrainSource(write_prompts(tmp_path / f"s{j}.jsonl", size, f"s{j}"), weight)
        for j, (size, weight) in enumerate(sizes_weights)
    )
    return PromptMixture(DataConfig(train_path=entries), build_char_tokenizer("0123456789 copy"), seed)


def sources_of(batch: DataProto) -> list[str]:
    return [answer.split("-")[0] for answer in batch.non_tensor_batch[keys.ANSWER]]


# ---- drawing by weight -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sizes_weights, batch_size",
    [
        ([(40, 3.0), (40, 1.0)], 8),  # 3:1
        ([(40, 3.0), (40, 1.0)], 1),  # 3:1 at batch size 1: no file is starved
        ([(30, 1.0), (7, 2.0), (11, 0.5)], 5),  # unequal row counts, weights that do not divide the batch
    ],
    ids=["3to1", "3to1-batch1", "unequal"],
)
def test_drawn_shares_follow_the_weights(tmp_path, sizes_weights, batch_size):
    data = mixture(tmp_path, sizes_weights)
    weights = np.array([weight for _, weight in sizes_weights])
    shares = weights / weights.sum()
    drawn = Counter()
    for step in range(400):
        drawn.update(sources_of(data.batch_at(step, batch_size)))
        total = (step + 1) * batch_size
        # StreamSplit's bound (no statistical tolerance needed): file j of J takes floor(rest*share + offset) of
        # what the files before it left, so after n prompts its count is within j + 1 <= J of n * share_j.
        for j, share in enumerate(shares):
            assert abs(drawn[f"s{j}"] - total * share) < len(shares), (step, j, drawn)
    assert sum(drawn.values()) == 400 * batch_size


def test_each_step_takes_its_share_at_once_when_the_weights_divide_the_batch(tmp_path):
    data = mixture(tmp_path, [(40, 3.0), (40, 1.0)])
    assert all(Counter(sources_of(data.batch_at(step, 8))) == {"s0": 6, "s1": 2} for step in range(50))
    assert all(data.counts_at(step, 8).tolist() == [6, 2] for step in range(50))


def test_the_split_tiles_the_stream_exactly_at_any_position():
    split = StreamSplit([0.1, 2.0, 1.0 / 3.0], [0.3, 0.9, 0.5])
    for total in [0, 1, 7, 10**6, 10**15, 10**15 + 1]:
        owned = split.owned(total)
        assert owned.sum() == total and (owned >= 0).all()
    previous = split.owned(0)
    for total in range(1, 3000):  # each count grows by 0 or 1 per position: windows neither overlap nor skip
        owned = split.owned(total)
        assert sorted((owned - previous).tolist()) == [0, 0, 1]
        previous = owned


# ---- determinism and epochs ----------------------------------------------------------------------------------
def test_batch_at_is_the_same_again_and_from_a_fresh_object(tmp_path):
    first = mixture(tmp_path, [(30, 1.0), (7, 2.0)], seed=5)
    resumed = mixture(tmp_path, [(30, 1.0), (7, 2.0)], seed=5)
    answers = lambda data, step: list(data.batch_at(step, 6).non_tensor_batch[keys.ANSWER])  # noqa: E731
    run = [answers(first, step) for step in range(20)]
    assert [answers(resumed, step) for step in (19, 3, 11, 0)] == [run[19], run[3], run[11], run[0]]
    assert [answers(first, step) for step in range(20)] == run  # asked again
    # The dynamic-sampling refill reads stream steps beyond 1e9: O(1), and as deterministic.
    far = 10**9 + 12 * 1024 + 1
    assert answers(first, far) == answers(resumed, far)
    assert [answers(mixture(tmp_path, [(30, 1.0), (7, 2.0)], seed=6), step) for step in range(3)] != run[:3]


@pytest.mark.parametrize("batch_size", [1, 4, 9])
def test_a_file_repeats_no_prompt_before_its_epoch_is_done(tmp_path, batch_size):
    data = mixture(tmp_path, [(13, 1.0), (5, 1.0), (9, 2.0)])
    sizes = {"s0": 13, "s1": 5, "s2": 9}
    seen = {name: Counter() for name in sizes}
    for step in range(60):
        for answer in data.batch_at(step, batch_size).non_tensor_batch[keys.ANSWER]:
            seen[answer.split("-")[0]][answer] += 1
        for name, counts in seen.items():
            # After k draws from a file of N rows every row was drawn floor(k/N) or ceil(k/N) times.
            times = [counts[f"{name}-{i}"] for i in range(sizes[name])]
            assert max(times) - min(times) <= 1, (step, name, times)


def test_each_file_has_its_own_order_reshuffled_per_epoch(tmp_path):
    data = mixture(tmp_path, [(10, 1.0), (10, 1.0)])
    orders = [source.indices_from(0, 30).tolist() for source in data.sources]
    assert orders[0] != orders[1]  # equal sizes, different permutations
    assert orders[0][:10] != orders[0][10:20] and sorted(orders[0][10:20]) == list(range(10))


# ---- data_source names -----------------------------------------------------------------------------------------
def test_data_source_from_the_entry_the_column_or_the_file_name(tmp_path, tokenizer):
    entries = (
        TrainSource(write_prompts(tmp_path / "gsm8k_train.jsonl", 4, "a", data_source="column"), data_source="named"),
        TrainSource(write_prompts(tmp_path / "math.jsonl", 4, "b", data_source="from_column")),
        TrainSource(write_prompts(tmp_path / "logic_puzzles.jsonl", 4, "c")),
    )
    data = PromptMixture(DataConfig(train_path=entries), tokenizer, seed=0)
    batch = data.batch_at(0, 12)
    by_file = {
        answer[0]: source
        for answer, source in zip(*(batch.non_tensor_batch[k] for k in (keys.ANSWER, keys.DATA_SOURCE)))
    }
    assert by_file == {"a": "named", "b": "from_column", "c": "logic_puzzles"}
    assert data.step_metrics(0, 12) == {
        "data/from_column/prompts": 4.0,
        "data/logic_puzzles/prompts": 4.0,
        "data/named/prompts": 4.0,
    }


# ---- one file: exactly as before --------------------------------------------------------------------------------
def test_one_path_gives_the_batches_it_always_gave(tmp_path, tokenizer):
    path = write_prompts(tmp_path / "train.jsonl", 7, "t")
    data = training_prompts(DataConfig(train_path=path), tokenizer, seed=7)
    assert type(data) is PromptDataset and data.step_metrics(1, 3) == {}
    # Row indices the implementation before mixtures gave for 7 rows, seed 7, batch size 3, steps 0..5.
    before = [[0, 5, 6], [2, 4, 1], [3, 3, 0], [2, 1, 4], [6, 5, 5], [0, 2, 3]]
    assert [data.indices_at(step, 3).tolist() for step in range(6)] == before
    assert list(data.batch_at(1, 3).non_tensor_batch[keys.ANSWER]) == ["t-2", "t-4", "t-1"]
    assert set(data.batch_at(0, 3).non_tensor_batch[keys.DATA_SOURCE]) == {""}  # no column: "" as before


# ---- metrics -----------------------------------------------------------------------------------------------------
def test_per_source_metrics_count_prompts_and_average_rewards():
    scores = torch.zeros(5, 3)
    scores[:, -1] = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.25])  # the score sits on the last response token
    batch = DataProto.from_dict(
        tensors={keys.TOKEN_LEVEL_SCORES: scores},
        non_tensors={keys.DATA_SOURCE: np.array(["gsm8k", "math", "gsm8k", "math", "math"], dtype=object)},
    )
    assert per_source_reward_metrics(batch) == {"reward/gsm8k/mean": 0.75, "reward/math/mean": pytest.approx(5 / 12)}
    assert per_source_prompt_metrics(batch, ["gsm8k", "math", "logic"]) == {
        "data/gsm8k/prompts": 2.0,
        "data/logic/prompts": 0.0,
        "data/math/prompts": 3.0,
    }
    batch.non_tensor_batch[keys.DATA_SOURCE][:] = ""  # one file without a data_source column: no reward//mean
    assert per_source_reward_metrics(batch) == {}


# ---- the config: a list of entries, its errors, and `validate` -----------------------------------------------------
@pytest.fixture()
def base(tmp_path) -> list[str]:
    return [f"output_dir={tmp_path}/run", "data.synthetic=null", "reward.rewards={exact_match: 1.0}"]


def problems_of(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(CONFIG, overrides)
    return info.value.problems


def test_a_list_of_entries_loads_and_round_trips(tmp_path, base):
    a, b = write_prompts(tmp_path / "a.jsonl", 6, "a"), write_prompts(tmp_path / "b.jsonl", 3, "b")
    config = load_config(
        CONFIG, [*base, f"data.train_path=[{{path: {a}, weight: 3}}, {{path: {b}, data_source: bee}}]"]
    )
    assert config.data.train_path == (TrainSource(a, 3.0), TrainSource(b, 1.0, "bee"))
    (tmp_path / "resolved.yaml").write_text(config_to_yaml(config))
    assert load_config(tmp_path / "resolved.yaml", []).data == config.data
    assert isinstance(check_data(config), PromptMixture)  # what `cli validate` loads before Ray
    assert cli.main(["validate", str(CONFIG), *base, f"data.train_path=[{{path: {a}}}, {{path: {b}}}]"]) == 0


def test_mixture_config_errors_name_the_entry_and_the_fix(tmp_path, base):
    a = write_prompts(tmp_path / "a.jsonl", 6, "a")
    missing = tmp_path / "missing.jsonl"
    problems = problems_of([*base, f"data.train_path=[{{path: {a}, weight: 0}}, {{path: {missing}, weight: -1}}]"])
    assert problems == [
        "data.train_path[0].weight=0.0 must be a finite number > 0 (its share of each step's prompts is weight / "
        "sum of weights); drop the entry to leave the file out",
        f"data.train_path[1].path={str(missing)!r} does not exist; point it at a JSONL or parquet file",
        "data.train_path[1].weight=-1.0 must be a finite number > 0 (its share of each step's prompts is weight / "
        "sum of weights); drop the entry to leave the file out",
    ]
    assert problems_of([*base, "data.train_path=[]"]) == [
        "data.train_path is an empty list; give one file, or at least one {path, weight, data_source} entry"
    ]
    # A misspelt key names the entry (not "expected str, got list").
    assert problems_of([*base, f"data.train_path=[{{path: {a}, wieght: 2}}]"]) == [
        "data.train_path[0].wieght: unknown key; did you mean 'weight'?"
    ]


# ---- data.source_weights: drawing by source (ROLL's domain_interleave_probs) ---------------------------------------
def write_tagged(path: Path, sources: list[str], tag: str) -> str:
    """One row per entry of `sources`, the row's data_source; its answer `tag-i` names the file and row."""
    rows = [{"prompt": f"copy {i}", "answer": f"{tag}-{i}", "data_source": name} for i, name in enumerate(sources)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def tagged_files(tmp_path) -> tuple[TrainSource, ...]:
    """Two files whose rows interleave three sources unevenly: 9 of math, 4 of code, 5 of chat."""
    first = write_tagged(tmp_path / "f.jsonl", ["math", "code", "math", "chat", "math", "math", "chat", "code"], "f")
    second = write_tagged(
        tmp_path / "g.jsonl", ["chat", "math", "math", "code", "math", "chat", "math", "chat", "code", "math"], "g"
    )  # noqa: E501
    return (TrainSource(first), TrainSource(second))


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_source_weights_draw_each_source_by_weight_and_each_of_its_rows_once_per_epoch(tmp_path, batch_size):
    entries = tagged_files(tmp_path)
    config = DataConfig(train_path=entries, source_weights={"math": 3.0, "code": 1.0, "chat": 0.0})
    data = PromptMixture(config, build_char_tokenizer("0123456789 copy"), seed=3)
    rows = {"math": 9, "code": 4}
    drawn, seen = Counter(), {name: Counter() for name in rows}
    for step in range(120):
        batch = data.batch_at(step, batch_size)
        sources, answers = (batch.non_tensor_batch[key] for key in (keys.DATA_SOURCE, keys.ANSWER))
        drawn.update(str(name) for name in sources)
        for name, answer in zip(sources, answers):
            seen[name][answer] += 1
        total = (step + 1) * batch_size
        assert "chat" not in drawn  # weight 0: left out
        assert abs(drawn["math"] - total * 0.75) < 2 and abs(drawn["code"] - total * 0.25) < 2, (step, drawn)
        for name, counts in seen.items():  # a source's rows (from both files) drawn floor or ceil of k / N times
            assert len(counts) <= rows[name]
            if sum(counts.values()) >= rows[name]:
                assert len(counts) == rows[name] and max(counts.values()) - min(counts.values()) <= 1, (step, counts)
    # The same again from a fresh object (a resumed run), and a step's metrics count its sources.
    again = PromptMixture(config, build_char_tokenizer("0123456789 copy"), seed=3)
    assert list(again.batch_at(57, batch_size).non_tensor_batch[keys.ANSWER]) == list(
        data.batch_at(57, batch_size).non_tensor_batch[keys.ANSWER]
    )
    assert set(data.step_metrics(0, batch_size)) == {"data/math/prompts", "data/code/prompts"}


def test_source_weights_on_one_file_make_it_a_mixture_of_its_sources(tmp_path, tokenizer):
    path = write_tagged(tmp_path / "one.jsonl", ["a"] * 6 + ["b"] * 2, "x")
    data = training_prompts(DataConfig(train_path=path, source_weights={"a": 1, "b": 1}), tokenizer, seed=0)
    assert isinstance(data, PromptMixture)
    assert all(Counter(map(str, data.batch_at(step, 4).non_tensor_batch[keys.DATA_SOURCE])) == {"a": 2, "b": 2}
               for step in range(10))  # fmt: skip


def test_source_weights_name_a_source_without_weight_and_a_weight_without_rows(tmp_path, tokenizer):
    entries = tagged_files(tmp_path)
    with pytest.raises(DataError) as info:
        PromptMixture(DataConfig(train_path=entries, source_weights={"math": 1.0}), tokenizer, seed=0)
    assert str(info.value) == (
        "data.source_weights gives no weight to the sources 'chat' (5 rows), 'code' (4 rows); give each a weight (0 "
        "leaves its rows out), or set data.source_key to the column that names the sources"
    )
    with pytest.raises(DataError) as info:
        weights = {"math": 1.0, "code": 1.0, "chat": 0.0, "maht": 2.0}
        PromptMixture(DataConfig(train_path=entries, source_weights=weights), tokenizer, seed=0)
    assert "names 'maht', which no training row has (the rows' sources: 'chat', 'code', 'math')" in str(info.value)


def test_source_weights_config_errors_say_what_to_change(tmp_path, base):
    a = write_tagged(tmp_path / "a.jsonl", ["p", "q"], "a")
    assert problems_of([*base, f"data.train_path={a}", "data.source_weights={p: -1, q: 0}"]) == [
        "data.source_weights={'p': -1.0, 'q': 0.0}: weights are finite numbers >= 0 (0 leaves a source out) and at "
        "least one is > 0"
    ]
    assert problems_of([*base, f"data.train_path=[{{path: {a}, weight: 2}}]", "data.source_weights={p: 1, q: 1}"]) == [
        "data.source_weights draws by source, so the data.train_path entries' weights would be ignored; drop one of "
        "the two"
    ]
    assert "data.source_weights weighs the sources of data.train_path's rows; set data.train_path" in problems_of(
        [f"output_dir={tmp_path}/run", "data.source_weights={p: 1}"]
    )
    config = load_config(CONFIG, [*base, f"data.train_path={a}", "data.source_weights={p: 2, q: 1}"])
    assert config.data.source_weights == {"p": 2.0, "q": 1.0} and isinstance(check_data(config), PromptMixture)
