"""Bad prompt data never trains silently: each broken input is refused with its file, line and key, by the
dataset itself, by `roll-backend validate/submit` before Ray starts and by `roll-backend run` before any rank starts
(it checks the data while Ray starts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_checks import assert_refused_before_ray, assert_run_refused_before_ranks

from roll_backend.config.schema import DataConfig
from roll_backend.models.tiny import build_char_tokenizer
from roll_backend.pipelines.data.prompt_dataset import PromptDataset
from roll_backend.pipelines.data.rows import DataError

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "grpo_tiny_cpu.yaml"  # char tokenizer "0123456789 copy"


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer("0123456789 abcdefghijklmnopqrstuvwxyz")


def write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def good(i: int) -> str:
    return json.dumps({"prompt": f"copy {i}", "answer": str(i)})


def load(path: str, tokenizer, **options) -> PromptDataset:
    return PromptDataset(DataConfig(train_path=path, shuffle=False, **options), tokenizer, seed=0)


def test_a_line_that_is_not_json_is_named_by_file_and_line(tmp_path, tokenizer):
    path = write_lines(tmp_path / "p.jsonl", [good(0), "", good(1), '{"prompt": "copy 2", "answer": 2'])
    with pytest.raises(DataError) as info:
        load(path, tokenizer)
    assert f"{path}:4: not valid JSON (Expecting ',' delimiter at column 33)" in str(info.value)
    assert info.value.__cause__ is None and info.value.__context__ is None  # no json/datasets chain


def test_a_missing_or_null_prompt_is_an_error_naming_file_line_and_key(tmp_path, tokenizer):
    path = write_lines(
        tmp_path / "p.jsonl",
        [
            good(0),
            json.dumps({"prompt": None, "answer": "1"}),
            good(2),
            json.dumps({"question": "copy 3", "answer": "3"}),
            "[1, 2]",
        ],
    )
    with pytest.raises(DataError) as info:
        load(path, tokenizer)
    message = str(info.value)
    assert f"{path}: 3 of 5 rows cannot train" in message
    assert f"{path}:2: 'prompt' is null" in message
    assert f"{path}:4: no 'prompt' key (the row has ['answer', 'question'])" in message
    assert f"{path}:5: expected a JSON object with 'prompt' and 'answer', got list" in message
    assert "data.skip_invalid_rows=true" in message


def test_skip_invalid_rows_skips_counts_and_reports_them(tmp_path, tokenizer):
    path = write_lines(tmp_path / "p.jsonl", [good(0), json.dumps({"prompt": None, "answer": "1"}), good(2), "{oops"])
    data = load(path, tokenizer, skip_invalid_rows=True, apply_chat_template=False)
    assert len(data) == 2 and data.skipped_rows == 2
    assert list(data.prompts) == ["copy 0", "copy 2"]  # never the text "None"
    assert data.metrics() == {"data/skipped_rows": 2}
    assert load(write_lines(tmp_path / "ok.jsonl", [good(0)]), tokenizer).metrics() == {}
    with pytest.raises(DataError, match="all 1 rows are invalid"):
        load(write_lines(tmp_path / "bad.jsonl", ["{oops"]), tokenizer, skip_invalid_rows=True)


def test_parquet_null_prompt_is_named_by_row(tmp_path, tokenizer):
    import pandas as pd

    path = tmp_path / "p.parquet"
    pd.DataFrame({"prompt": ["copy 1", None], "answer": ["1", "2"]}).to_parquet(path)
    with pytest.raises(DataError, match=rf"{path}: row 2: 'prompt' is null"):
        load(str(path), tokenizer)


def test_characters_the_char_tokenizer_lacks_are_named(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"prompt": "larger 3 8", "answer": "8"}), good(1)])
    with pytest.raises(DataError) as info:
        load(path, build_char_tokenizer("0123456789 copy"), apply_chat_template=False)
    message = str(info.value)
    assert "1 prompts have characters the tokenizer has no token for ('g', 'l')" in message
    assert f"{path}:1: 'g', 'l' in 'larger 3 8' (would train as 'arer 3 8')" in message
    assert "char_alphabet" in message


# ---- the command line: refused before Ray starts, without a traceback -------------------------------------
@pytest.fixture()
def file_config(tmp_path) -> list[str]:
    return [f"output_dir={tmp_path}/run", "data.synthetic=null", "reward.rewards={exact_match: 1.0}"]


@pytest.mark.parametrize(
    "lines, message",
    [
        ([good(0), "not json"], "p.jsonl:2: not valid JSON (Expecting value at column 1)"),
        ([good(0), json.dumps({"prompt": None, "answer": "1"})], "p.jsonl:2: 'prompt' is null"),
        (
            [json.dumps({"question": "copy 0", "answer": "0"})],
            "no column 'prompt'; columns present: ['question', 'answer']",
        ),
        (
            [json.dumps({"prompt": "larger 3 8", "answer": "8"})],
            "p.jsonl:1: 'g', 'l' in 'larger 3 8' (would train as 'arer 3 8')",
        ),
    ],
    ids=["not_json", "null_prompt", "no_prompt_column", "char_alphabet"],
)
@pytest.mark.parametrize("command", ["run", "validate"])
def test_cli_refuses_bad_data_before_ranks_start(
    ray_session, tmp_path, file_config, monkeypatch, capsys, command, lines, message
):
    """(With the test session's Ray up: `run` called in a process that runs Ray leaves it up.)"""
    path = write_lines(tmp_path / "p.jsonl", lines)
    args = [str(CONFIG), *file_config, f"data.train_path={path}"]
    if command == "run":
        err = assert_run_refused_before_ranks(monkeypatch, capsys, args, message)
    else:
        err = assert_refused_before_ray(monkeypatch, capsys, [command, *args], message)
    assert "invalid data" in err


def test_submit_refuses_bad_data_before_contacting_the_cluster(tmp_path, file_config, monkeypatch, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.read_text())
    path = write_lines(tmp_path / "p.jsonl", [good(0), "not json"])
    monkeypatch.chdir(tmp_path)  # the job's working dir; nothing answers on port 1, so nothing was sent
    assert_refused_before_ray(
        monkeypatch,
        capsys,
        ["submit", "--address", "http://127.0.0.1:1", "run.yaml", *file_config, f"data.train_path={path}"],
        "p.jsonl:2: not valid JSON",
    )
