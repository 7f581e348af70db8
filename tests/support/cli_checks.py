"""Checks shared by the CLI-level tests of bad input: the command refuses with a message, before Ray starts."""

from __future__ import annotations

from roll_backend import cli


def assert_refused_before_ray(monkeypatch, capsys, argv: list[str], message: str) -> str:
    """`roll-backend ARGV` exits 2 with `message` on stderr, no traceback, and never started Ray; returns stderr."""
    import ray

    from roll_backend.distributed import ray_env

    ray_was_up = ray.is_initialized()
    starts = []
    monkeypatch.setattr(ray_env, "init_local_ray", lambda **kwargs: starts.append(kwargs))
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err
    assert starts == [] and ray.is_initialized() == ray_was_up
    return err
