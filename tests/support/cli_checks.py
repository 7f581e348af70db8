"""Checks shared by the CLI-level tests of bad input: the command refuses with a message before Ray starts (a config
problem), or, for `run`, before any rank starts (a data problem: `run` checks the data while Ray starts)."""

from __future__ import annotations

import concurrent.futures

from roll_backend import cli


def assert_refused_before_ray(monkeypatch, capsys, argv: list[str], message: str) -> str:
    """`roll-backend ARGV` exits 2 with `message` on stderr, no traceback, and never started Ray; returns stderr."""
    import ray

    from roll_backend.distributed import ray_env

    ray_was_up = ray.is_initialized()
    starts = []
    monkeypatch.setattr(ray_env, "init_local_ray", lambda **kwargs: starts.append(kwargs))
    err = _refused(capsys, argv, message)
    assert starts == [] and ray.is_initialized() == ray_was_up
    return err


def assert_run_refused_before_ranks(monkeypatch, capsys, argv: list[str], message: str) -> str:
    """`roll-backend run ARGV` exits 2 with `message` on stderr and no traceback, having started Ray (stood in for
    here) and run no pipeline (so no rank started), and leaves a Ray that was up before it up; returns stderr."""
    import ray

    import roll_backend.pipelines
    from roll_backend.distributed import ray_env

    ray_was_up = ray.is_initialized()
    ray_started: concurrent.futures.Future = concurrent.futures.Future()
    ray_started.set_result(None)
    starts, runs = [], []
    monkeypatch.setattr(ray_env, "start_local_ray", lambda **kwargs: starts.append(kwargs) or ray_started)
    monkeypatch.setattr(roll_backend.pipelines, "run_with_restarts", lambda *args: runs.append(args))
    err = _refused(capsys, ["run", *argv], message)
    assert len(starts) == 1 and runs == [] and ray.is_initialized() == ray_was_up
    return err


def _refused(capsys, argv: list[str], message: str) -> str:
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err
    return err
