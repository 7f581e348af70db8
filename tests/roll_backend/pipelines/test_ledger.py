"""The prompt ledger (roll_backend/pipelines/services/ledger.py): flushed per step, copied into checkpoints, continued
from a checkpoint's copy on resume, and checked by `roll-backend ledger RUN_DIR` (a position trained twice or left
without a reason is a problem; a torn last line from a killed driver is not)."""

from __future__ import annotations

from pathlib import Path

from roll_backend import cli
from roll_backend.pipelines.services.ledger import LEDGER_FILE, REFILL_BASE, PromptLedger, refill_positions, report


def test_a_resumed_run_continues_from_the_checkpoint_s_copy_and_trains_each_position_once(tmp_path, capsys):
    ledger = PromptLedger(tmp_path)
    assert ledger.begin(None)
    for step in (1, 2):
        ledger.record("admitted", [2 * step, 2 * step + 1])
        ledger.record("trained", [2 * step, 2 * step + 1])
        assert ledger.flush(step) == {"ledger/admitted": 2.0, "ledger/trained": 2.0}
    checkpoint = tmp_path / "checkpoints" / "step_2"
    checkpoint.mkdir(parents=True)
    ledger.save_to(checkpoint)
    ledger.record("admitted", [6, 7])  # step 3 ran, then the driver was killed mid-write
    ledger.record("trained", [6, 7])
    ledger.flush(3)
    with (tmp_path / LEDGER_FILE).open("a") as file:
        file.write('{"step": 4, "admit')
    summary, problems = report(tmp_path)
    assert problems == [] and "6 positions" in summary  # (the torn line is left out)

    resumed = PromptLedger(tmp_path)
    assert resumed.begin(checkpoint)  # steps 3.. run again: their first events are gone
    for step in (3, 4):
        resumed.record("admitted", [2 * step, 2 * step + 1])
        resumed.record("trained", [2 * step, 2 * step + 1])
        resumed.flush(step)
    summary, problems = report(tmp_path)
    assert problems == [] and "8 trained exactly once" in summary
    assert cli.main(["ledger", str(tmp_path)]) == 0
    assert "8 positions (8 of the data stream, 0 refill)" in capsys.readouterr().out


def test_a_position_trained_twice_or_left_without_a_reason_is_a_problem(tmp_path, capsys):
    ledger = PromptLedger(tmp_path)
    ledger.begin(None)
    refill = refill_positions(step=1, round_index=1, max_rounds=1024, count=2)
    assert refill[0] >= REFILL_BASE and refill[1] == refill[0] + 1
    ledger.record("admitted", [2, 3, 4, 5, *refill])
    ledger.record("trained", [2, 3])
    ledger.record("filtered", [5, refill[0]])
    ledger.record("trained", [refill[1]])
    ledger.record("in_flight_at_checkpoint", [4])  # never generated again
    ledger.flush(1)
    ledger.record("trained", [3])
    ledger.flush(2)
    summary, problems = report(tmp_path)
    assert problems == [
        "position 3 was trained 2 times (last at step 2)",
        "position 4: last 'in_flight_at_checkpoint' at step 1, then nothing",
    ]
    assert "(4 of the data stream, 2 refill)" in summary
    assert cli.main(["ledger", str(tmp_path)]) == 1
    assert "problem: position 3 was trained 2 times" in capsys.readouterr().out
    assert cli.main(["ledger", str(Path(tmp_path) / "nowhere")]) == 1


def test_evaluation_leaves_a_run_s_ledger_alone_until_a_loop_begins(tmp_path):
    """PipelineRun makes a ledger for every run, evaluation included; only the training loop's `begin` rewrites it."""
    (tmp_path / LEDGER_FILE).write_text('{"step": 1, "admitted": [2], "trained": [2]}\n')
    PromptLedger(tmp_path)
    assert report(tmp_path)[1] == []
    assert (tmp_path / LEDGER_FILE).read_text() != ""
