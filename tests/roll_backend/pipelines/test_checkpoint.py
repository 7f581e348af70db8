"""Run checkpoints: a save killed half-way never becomes the latest; old ones are pruned (never for a damaged newer
one); driver RNG round-trips; the manifest written last decides what is complete; `resume` (auto or a folder) is
checked before Ray starts; a rank failing to load names the checkpoint and the files to suspect."""

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from roll_backend import cli
from roll_backend.pipelines.services import checkpoint as ckpt

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "configs" / "grpo_tiny_cpu.yaml"


def save(output_dir, step: int, keep_last: int = 3, files: dict[str, bytes] | None = None) -> Path:
    """A checkpoint as PipelineRun writes one: role files staged, then committed with the driver's state."""
    staged = ckpt.staging_dir(output_dir, step)
    for name, content in (files or {"actor/__0_0.distcp": bytes(range(256)) * 40, "actor/.metadata": b"meta"}).items():
        (staged / name).parent.mkdir(parents=True, exist_ok=True)
        (staged / name).write_bytes(content)
    return ckpt.commit_checkpoint(staged, {"step": step}, keep_last=keep_last)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_half_written_save_is_never_the_latest(tmp_path):
    first = ckpt.staging_dir(tmp_path, 2)
    (first / "actor").mkdir()
    ckpt.commit_checkpoint(first, {"step": 2}, keep_last=2)
    killed = ckpt.staging_dir(tmp_path, 4)  # the process dies while the roles are still writing
    (killed / "actor").mkdir()
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest.name == "step_2" and ckpt.load_driver_state(latest) == {"step": 2}
    # The next save of that step starts clean and then becomes the latest.
    again = ckpt.staging_dir(tmp_path, 4)
    assert not (again / "actor").exists()
    assert ckpt.commit_checkpoint(again, {"step": 4}, keep_last=2).name == "step_4"
    assert ckpt.latest_checkpoint(tmp_path).name == "step_4"


def test_only_the_last_checkpoints_are_kept(tmp_path):
    for step in (1, 2, 3, 4):
        ckpt.commit_checkpoint(ckpt.staging_dir(tmp_path, step), {"step": step}, keep_last=2)
    assert sorted(p.name for p in ckpt.checkpoint_root(tmp_path).iterdir()) == ["step_3", "step_4"]


def test_driver_rng_state_round_trips_through_json(tmp_path):
    state = ckpt.driver_rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    ckpt.commit_checkpoint(ckpt.staging_dir(tmp_path, 1), {"rng": state}, keep_last=1)
    ckpt.restore_driver_rng(ckpt.load_driver_state(ckpt.latest_checkpoint(tmp_path))["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_a_damaged_newer_checkpoint_never_pushes_out_the_one_just_written(tmp_path):
    for step in (2, 4, 6):
        save(tmp_path, step, keep_last=2)
    truncate(tmp_path / "checkpoints" / "step_6" / ckpt.DRIVER_STATE)  # auto resumes from step_4 and saves step_5
    save(tmp_path, 5, keep_last=2)
    assert sorted(p.name for p in ckpt.checkpoint_root(tmp_path).iterdir()) == ["step_4", "step_5", "step_6"]
    assert ckpt.latest_checkpoint(tmp_path).name == "step_5"
    save(tmp_path, 6, keep_last=2)  # the run reaches the damaged one's step: replaced, the oldest pruned
    assert sorted(p.name for p in ckpt.checkpoint_root(tmp_path).iterdir()) == ["step_5", "step_6"]
    assert ckpt.checkpoint_problem(tmp_path / "checkpoints" / "step_6") is None


# ---- the manifest -------------------------------------------------------------------------------------------
def test_commit_writes_a_manifest_listing_every_file_with_size_and_digest(tmp_path):
    folder = save(
        tmp_path,
        2,
        files={
            "actor/__0_0.distcp": b"x" * 1000,
            "actor/__1_0.distcp": b"y" * 10,
            "actor/sub/common.pt": b"",
            "critic/a": b"c",
        },
    )
    manifest = json.loads((folder / ckpt.MANIFEST).read_text())
    assert manifest["version"] == ckpt.MANIFEST_VERSION
    assert sorted(manifest["files"]) == [
        "actor/__0_0.distcp",
        "actor/__1_0.distcp",
        "actor/sub/common.pt",
        "critic/a",
        ckpt.DRIVER_STATE,
    ]  # every rank's shard, the driver's state
    assert manifest["files"]["actor/__0_0.distcp"]["size"] == 1000
    assert manifest["files"][ckpt.DRIVER_STATE]["size"] == (folder / ckpt.DRIVER_STATE).stat().st_size
    assert all(len(record["blake2b"]) == 32 for record in manifest["files"].values())  # small files: whole content
    assert ckpt.checkpoint_problem(folder) is None


def test_big_files_are_checked_by_size_and_the_digest_of_their_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "FULL_HASH_BYTES", 64)
    monkeypatch.setattr(ckpt, "HASH_BLOCK_BYTES", 16)
    content = bytes(range(200))
    folder = save(tmp_path, 2, files={"actor/shard": content, "actor/small": b"s" * 64})
    files = json.loads((folder / ckpt.MANIFEST).read_text())["files"]
    assert set(files["actor/shard"]) == {"size", "blake2b_ends"} and set(files["actor/small"]) == {"size", "blake2b"}
    shard = folder / "actor" / "shard"
    shard.write_bytes(content[:100] + b"\xff" + content[101:])  # the middle: documented as not seen
    assert ckpt.checkpoint_problem(folder) is None
    shard.write_bytes(content[:-1] + b"\xff")  # the tail (a half-written end)
    assert ckpt.checkpoint_problem(folder) == (
        "actor/shard has the recorded size but other content than its manifest's blake2b_ends digest (damaged)"
    )
    (folder / "actor" / "small").write_bytes(b"t" * 64)  # small files: any byte
    shard.write_bytes(content)
    assert "actor/small has the recorded size but other content" in ckpt.checkpoint_problem(folder)


def test_a_manifest_that_is_not_one_is_reported(tmp_path):
    folder = save(tmp_path, 2)
    (folder / ckpt.MANIFEST).write_text('{"version": 1, "files": {"actor/.metadata": {"blake2b": "00"}}}')
    assert ckpt.checkpoint_problem(folder) == (
        "its manifest.json is unreadable (ValueError: no 'files' table of {file: {size, digest}})"
    )
    (folder / ckpt.MANIFEST).write_text('{"version": 1, "fi')  # torn
    assert ckpt.checkpoint_problem(folder).startswith("its manifest.json is unreadable (JSONDecodeError: ")


# ---- choosing the checkpoint to resume from -----------------------------------------------------------------
def test_auto_skips_a_truncated_newest_checkpoint_naming_the_file(tmp_path, caplog):
    for step in (2, 4, 6):
        save(tmp_path, step)
    truncate(tmp_path / "checkpoints" / "step_6" / "actor" / "__0_0.distcp")
    with caplog.at_level(logging.INFO, logger=ckpt.__name__):
        assert ckpt.resume_checkpoint("auto", tmp_path) == tmp_path / "checkpoints" / "step_4"
    assert [r.getMessage() for r in caplog.records] == [
        (
            f"resume=auto skips checkpoint {tmp_path / 'checkpoints' / 'step_6'}: actor/__0_0.distcp has 5120 bytes, "
            f"its manifest says 10240 (truncated or overwritten)"
        ),
        f"resume=auto: the run resumes from {tmp_path / 'checkpoints' / 'step_4'}",
    ]


def test_auto_skips_folders_without_a_manifest_or_missing_a_file(tmp_path, caplog):
    save(tmp_path, 2)
    (save(tmp_path, 4) / ckpt.MANIFEST).unlink()  # e.g. written before manifests existed
    (save(tmp_path, 6) / "actor" / ".metadata").unlink()
    with caplog.at_level(logging.WARNING, logger=ckpt.__name__):
        assert ckpt.latest_checkpoint(tmp_path).name == "step_2"
    step_6, step_4 = [r.getMessage() for r in caplog.records]
    assert step_6.endswith("step_6: actor/.metadata is missing (its manifest lists 4 bytes)")
    assert step_4.endswith(
        "step_4: it has no manifest.json: its save did not finish, or it was written before "
        "checkpoints had manifests (issue #27), so nothing says its files are whole"
    )
    truncate(tmp_path / "checkpoints" / "step_2" / ckpt.DRIVER_STATE)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=ckpt.__name__):
        assert ckpt.resume_checkpoint("auto", tmp_path) is None  # nothing complete left: the run starts from step 1
    assert caplog.records[-1].getMessage() == (
        f"resume=auto: no complete checkpoint under {tmp_path / 'checkpoints'}; the run starts from step 1"
    )


def test_an_explicit_incomplete_checkpoint_is_refused_naming_folder_and_file(tmp_path):
    save(tmp_path, 2)
    bad = save(tmp_path, 4)
    truncate(bad / "actor" / "__0_0.distcp")
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.resume_checkpoint(str(bad), tmp_path)
    message = str(info.value)
    assert message.startswith(f"checkpoint {bad} is not complete: actor/__0_0.distcp has 5120 bytes, its manifest")
    assert "Resume from an older complete checkpoint" in message and "checkpoint.resume=auto" in message
    with pytest.raises(ckpt.CheckpointError, match="step_9 is not complete: it does not exist"):
        ckpt.resume_checkpoint(str(tmp_path / "checkpoints" / "step_9"), tmp_path)
    good = tmp_path / "checkpoints" / "step_2"
    assert ckpt.resume_checkpoint(str(good), tmp_path) == good
    assert ckpt.resume_checkpoint(None, tmp_path) is None
    (bad / ckpt.DRIVER_STATE).unlink()
    with pytest.raises(ckpt.CheckpointError, match=f"checkpoint {bad} is not complete: it has no driver_state.json"):
        ckpt.load_driver_state(bad)


def test_a_rank_failing_to_load_names_the_checkpoint_and_the_files_to_suspect(tmp_path, monkeypatch):
    from roll_backend.distributed.worker_group import RankRaisedError

    folder = save(tmp_path, 2)
    rank_error = "actor_train.load_checkpoint failed on [rank 0/2]: CheckpointingException: "

    def load_failing(message: str, restartable: bool = True) -> str:
        with pytest.raises(ckpt.CheckpointError if restartable else RankRaisedError) as info, ckpt.loading(folder):
            raise RankRaisedError(rank_error + message, restartable=restartable)
        assert (
            str(info.value).startswith(
                f"loading checkpoint {folder} failed although its files match its manifest"
                f": {rank_error}{message}. Suspect: "
            )
            or not restartable
        )
        return str(info.value)

    assert "Suspect: the rank's error names actor/__0_0.distcp. Resume from an older" in load_failing(
        f"cannot read {folder}/actor/__0_0.distcp at offset 512"
    )
    assert "Suspect: every file matches its manifest's digest of its whole content" in load_failing("shape mismatch")
    assert load_failing("a reward function raised", restartable=False).endswith("a reward function raised")
    monkeypatch.setattr(ckpt, "FULL_HASH_BYTES", 64)
    folder = save(tmp_path, 4, files={f"actor/__{rank}_0.distcp": bytes(100) for rank in range(6)})
    assert (
        "Suspect: the manifest checks only the size, head and tail of 6 big file(s) (actor/__0_0.distcp, "
        "actor/__1_0.distcp, actor/__2_0.distcp, actor/__3_0.distcp, ...): damage in the middle"
    ) in load_failing("unpickling error")


# ---- before Ray starts ------------------------------------------------------------------------------------
def test_validate_and_run_check_the_resume_choice_before_ray_starts(tmp_path, capsys, caplog):
    save(tmp_path, 2)
    truncate(save(tmp_path, 4) / "actor" / ".metadata")
    step_4 = tmp_path / "checkpoints" / "step_4"
    for command in ("validate", "run"):  # run: the usage error comes before the command builds anything
        args = [command, str(CONFIG), f"output_dir={tmp_path}", f"checkpoint.resume={step_4}"]
        assert cli.main(args) == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert f"checkpoint {step_4} is not complete: actor/.metadata has 2 bytes, its manifest says 4" in err, err
    with caplog.at_level(logging.INFO, logger=ckpt.__name__):
        assert cli.main(["validate", str(CONFIG), f"output_dir={tmp_path}", "checkpoint.resume=auto"]) == cli.EXIT_OK
    assert [r.getMessage() for r in caplog.records if r.name == ckpt.__name__] == [
        f"resume=auto skips checkpoint {step_4}: actor/.metadata has 2 bytes, its manifest says 4 (truncated or "
        f"overwritten)",
        f"resume=auto: the run resumes from {tmp_path / 'checkpoints' / 'step_2'}",
    ]
