"""Run checkpoints: a save killed half-way never becomes the latest; old ones are pruned; driver RNG round-trips."""

import random

import numpy as np
import torch

from roll_backend.pipelines import checkpoint as ckpt


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
