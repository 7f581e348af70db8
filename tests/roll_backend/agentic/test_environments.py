"""Tests for roll_backend/agentic/environments.py: GEM envs by id, gymnasium's FrozenLake through GymTextEnv, user env
classes from a file, and EnvSpec's checks."""

from __future__ import annotations

import re
import textwrap

import pytest

from roll_backend.agentic.environments import EnvOutputError, EnvSpec, GymTextEnv, make_env, reset_env, step_env
from roll_backend.errors import UserCodeError

FROZEN_LAKE = EnvSpec(gymnasium="FrozenLake-v1", kwargs={"is_slippery": False})
OPTIMAL_4X4 = ["down", "down", "right", "right", "down", "right"]  # S(0,0) -> G(3,3) around the holes


# ---- gem-llm ------------------------------------------------------------------------------------------------------


def _play_guess_the_number(env, seed: int) -> list[tuple]:
    """Binary search from the hints; the whole episode's (observation, reward, terminated, truncated) in order."""
    observation, _ = reset_env(env, seed=seed)
    episode = [(observation,)]
    low, high = 1, 10
    terminated = truncated = False
    while not (terminated or truncated):
        guess = (low + high) // 2
        observation, reward, terminated, truncated, _ = step_env(env, f"I guess \\boxed{{{guess}}}")
        episode.append((observation, reward, terminated, truncated))
        if "lower" in observation:
            high = guess - 1
        elif "higher" in observation:
            low = guess + 1
    return episode


def test_gem_game_by_id_is_reproducible_under_a_seed_and_plays():
    spec = EnvSpec(gem="game:GuessTheNumber-v0-easy")
    assert spec.label == "gem:game:GuessTheNumber-v0-easy"
    first = _play_guess_the_number(make_env(spec), seed=7)
    second = _play_guess_the_number(make_env(spec), seed=7)
    assert first == second
    assert "Guess The Number" in first[0][0]
    assert all(isinstance(step[0], str) for step in first)
    observation, reward, terminated, truncated = first[-1]
    assert terminated and not truncated and reward == 1.0, first  # binary search on 1..10 wins within 4 turns
    assert "Congratulations" in observation


# ---- gymnasium through GymTextEnv -----------------------------------------------------------------------------------


def test_frozen_lake_optimal_path_reaches_the_goal():
    env = make_env(FROZEN_LAKE)
    observation, _ = reset_env(env, seed=0, task={"prompt": "p", "answer": "a", "extra_info": {}})
    assert "left, down, right, up" in observation
    assert observation.endswith("PFFF\nFHFH\nFFFH\nHFFG")
    rewards = []
    for action in OPTIMAL_4X4:
        observation, reward, terminated, truncated, info = step_env(env, f"I move {action}.")
        rewards.append(reward)
    assert rewards == [0.0] * 5 + [1.0]
    assert terminated and not truncated and info["success"] is True
    assert observation == "SFFF\nFHFH\nFFFH\nHFFP"


def test_frozen_lake_hole_ends_the_episode_without_reward():
    env = make_env(FROZEN_LAKE)
    reset_env(env, seed=0)
    step_env(env, "right")
    observation, reward, terminated, truncated, info = step_env(env, "down")
    assert (reward, terminated, truncated, info["success"]) == (0.0, True, False, False)
    assert observation.splitlines()[1] == "FPFH"  # P on the hole at (1, 1)


def test_frozen_lake_invalid_text_does_not_move():
    env = make_env(EnvSpec(gymnasium="FrozenLake-v1", kwargs={"is_slippery": False, "text": {"instructions": False}}))
    first, _ = reset_env(env, seed=0)
    assert first == "PFFF\nFHFH\nFFFH\nHFFG"  # no instruction line
    observation, reward, terminated, truncated, info = step_env(env, "I would rather jump")
    assert info["invalid_action"] is True and (reward, terminated, truncated) == (0.0, False, False)
    assert "not understood" in observation and "left, down, right, up" in observation
    assert observation.endswith(first)
    observation, *_ = step_env(env, "down")
    assert observation == "SFFF\nPHFH\nFFFH\nHFFG"


def test_action_parsing_takes_the_last_action_word_or_index():
    env = make_env(FROZEN_LAKE)
    assert env.parse_action("not LEFT, but down") == 1
    assert env.parse_action("Right?\nactually: Up") == 3
    assert env.parse_action("action 2") == 2
    assert env.parse_action("upward, leftover, 13, 2x2") is None
    named = GymTextEnv(env.env, action_names=["w", "s", "e", "n"], invalid_action_reward=-0.5)
    assert named.parse_action("go n") == 3
    reset_env(named, seed=0)
    assert step_env(named, "up")[1] == -0.5  # the default names no longer count
    with pytest.raises(ValueError, match="has 2 names"):
        GymTextEnv(env.env, action_names=["a", "b"])


def test_gymnasium_env_without_discrete_spaces_is_refused():
    with pytest.raises(UserCodeError, match="Discrete action and observation spaces"):
        make_env(EnvSpec(gymnasium="CartPole-v1"))


# ---- user environments from a file --------------------------------------------------------------------------------

USER_ENV = textwrap.dedent(
    """
    class CountdownEnv:
        def __init__(self, start, bonus=0.0):
            self.start, self.bonus = start, bonus

        def reset(self, seed=None, options=None):
            self.left = self.start + (seed or 0)
            self.task = options
            return f"count down from {self.left}: {options['prompt']}", {"answer": options["answer"]}

        def step(self, action):
            self.left -= 1
            done = self.left == 0
            return f"{self.left} left", (1.0 + self.bonus) if done else 0.0, done, False, {}


    class SeedOnlyEnv:
        def reset(self, seed=None):
            return f"seed {seed}", {}

        def step(self, action):
            return "x", "a lot", False, False, {}


    class BrokenEnv:
        def __init__(self):
            raise RuntimeError("no licence for this game")
    """
)


@pytest.fixture
def user_env_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(USER_ENV)
    return str(path)


def test_user_env_class_gets_kwargs_and_the_task_row(user_env_file):
    spec = EnvSpec(path=user_env_file, name="CountdownEnv", kwargs={"start": 2, "bonus": 0.5})
    assert spec.label == "my_env.CountdownEnv" and spec.problems("agentic.env") == []
    env = make_env(spec)
    task = {"prompt": "what is 1+1?", "answer": "2", "extra_info": {"level": 1}}
    observation, info = reset_env(env, seed=1, task=task, label=spec.label)
    assert observation == "count down from 3: what is 1+1?" and info == {"answer": "2"}
    assert env.task == task
    assert [step_env(env, "tick")[1:3] for _ in range(3)] == [(0.0, False), (0.0, False), (1.5, True)]


def test_user_env_without_options_gets_the_seed_and_bad_output_is_named(user_env_file):
    spec = EnvSpec(path=user_env_file, name="SeedOnlyEnv")
    env = make_env(spec)
    assert reset_env(env, seed=5, task={"prompt": "p"}) == ("seed 5", {})
    with pytest.raises(EnvOutputError, match=r"my_env\.SeedOnlyEnv: step\(\) returned reward 'a lot'"):
        step_env(env, "go", label=spec.label)


def test_user_env_constructor_error_names_the_env(user_env_file):
    with pytest.raises(UserCodeError, match=r"my_env\.BrokenEnv .* raised RuntimeError: no licence"):
        make_env(EnvSpec(path=user_env_file, name="BrokenEnv"))


# ---- EnvSpec checks ------------------------------------------------------------------------------------------------


def test_env_spec_needs_exactly_one_source():
    with pytest.raises(ValueError, match=r"exactly one of .*got gem='a' and gymnasium='b'; keep one"):
        EnvSpec(gem="a", gymnasium="b")
    with pytest.raises(ValueError, match="got none"):
        EnvSpec()
    with pytest.raises(ValueError, match="needs `name`"):
        EnvSpec(path="my_env.py")
    with pytest.raises(ValueError, match="needs `path`"):
        EnvSpec(gymnasium="FrozenLake-v1", name="X")


def test_env_spec_problems_suggest_close_ids():
    (problem,) = EnvSpec(gem="game:GuessTheNumbr-v0-easy").problems("agentic.env")
    assert problem.startswith("agentic.env.gem='game:GuessTheNumbr-v0-easy' is no environment registered by gem-llm")
    assert re.search(r"closest: game:GuessTheNumber-v0-easy", problem)
    problems = EnvSpec(gymnasium="FrozenLak-v1", kwargs={"text": {"instruction": False}}).problems("agentic.env")
    assert "closest: FrozenLake-v1" in problems[0]
    assert "agentic.env.kwargs.text has unknown keys ['instruction']; known: instructions" in problems[1]
    with pytest.raises(ValueError, match="closest: game:GuessTheNumber-v0-easy"):
        make_env(EnvSpec(gem="game:GuessTheNumbr-v0-easy"))


def test_env_spec_problems_for_user_files(user_env_file, tmp_path):
    (missing,) = EnvSpec(path=str(tmp_path / "nowhere.py"), name="Env").problems("agentic.env")
    assert missing.startswith("agentic.env.path=") and "is no file" in missing
    (unnamed,) = EnvSpec(path=user_env_file, name="MyEnv").problems("agentic.env")
    assert "agentic.env.name='MyEnv'" in unnamed
    assert unnamed.endswith("classes there: BrokenEnv, CountdownEnv, SeedOnlyEnv")


def test_gem_runs_model_code_in_our_sandbox(tmp_path):
    """gem-llm's own code runner (its code environments' tests, its python tool) goes through roll-backend's sandbox
    once a GEM environment is built: the code's output comes back, and the host's files and network are out of
    reach (gem's default would run it as a plain subprocess)."""
    import importlib

    from roll_backend.agentic.environments import EnvSpec, make_env
    from roll_backend.patches.gem_sandbox import GEM_MODULES

    make_env(EnvSpec(gem="game:GuessTheNumber-v0-easy"))
    for name in GEM_MODULES:
        assert getattr(importlib.import_module(name).run_python, "roll_backend_sandbox", False), name
    from gem.tools.python_code_tool import PythonCodeTool as GemPythonTool
    from gem.utils.sandbox import run_python as gem_run_python

    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    code = f"```python\nprint(6 * 7)\nprint(open({str(secret)!r}).read())\n```"
    _, _, text, _ = GemPythonTool(timeout=5).execute_action(code)  # (valid, has_error, observation, parsed action)
    assert "42" in text and "hunter2" not in text and "FileNotFoundError" in text, text
    ok, stdout, _ = gem_run_python("import sys\nprint(sys.stdin.read()[::-1])", "none", stdin="abc", timeout=5)
    assert ok and stdout == "cba\n"  # a code environment's test input arrives on stdin
