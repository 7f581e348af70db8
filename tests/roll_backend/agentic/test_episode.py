"""One trajectory's environment side (agentic.episode): tool calls in a reply run and answer as tool messages (a
failing tool answers with its error and the episode goes on), other replies are the environment's action; without an
environment a reply with no tool call ends the trajectory. The config names what it cannot find before any run."""

from __future__ import annotations

import json

import pytest

from roll_backend.agentic.config import AgenticConfig, ToolSpec
from roll_backend.agentic.environments import EnvSpec
from roll_backend.agentic.episode import Episode, EpisodeSpec

TOOLS = (ToolSpec(builtin="calculator"), ToolSpec(builtin="python", kwargs={"wall_s": 3.0, "cpu_s": 1.0}))


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture
def broken_tool(tmp_path):
    source = tmp_path / "my_tools.py"
    source.write_text("def lookup(key: str) -> str:\n    '''Look a key up.'''\n    raise KeyError(f'no entry {key}')\n")
    return ToolSpec(path=str(source), name="lookup")


def test_tool_calls_answer_as_tool_messages_and_errors_do_not_stop_the_episode(broken_tool):
    episode = Episode(EpisodeSpec(env=None, tools=(*TOOLS, broken_tool)))
    assert [schema["function"]["name"] for schema in episode.tool_schemas()] == ["calculator", "python", "lookup"]
    assert episode.reset(None, {"prompt": "hi"}).messages == []  # the row's prompt opens a tools-only trajectory

    outcome = episode.act("let me compute " + call("calculator", expression="6 * 7") + call("lookup", key="x"))
    assert not outcome.done and (outcome.tool_calls, outcome.tool_errors) == (2, 1)
    answer, failure = outcome.messages
    assert answer == {"role": "tool", "name": "calculator", "content": "42"}
    assert failure["role"] == "tool" and "no entry x" in failure["content"]

    sandboxed = episode.act(call("python", code="while True: pass"))  # the sandbox's limit, not a hang
    # Its CPU-time limit, or on a loaded machine (the loop gets less than a core) its wall-clock one, whichever first.
    stopped_by = sandboxed.messages[0]["content"]
    assert not sandboxed.done and sandboxed.tool_errors == 1
    assert "CPU time limit" in stopped_by or "(wall clock)" in stopped_by, stopped_by
    garbled = episode.act("<tool_call>{not json</tool_call>")
    assert garbled.tool_errors == 1 and garbled.messages[0]["content"].startswith("error:")

    final = episode.act("the answer is 42")
    assert final.done and final.messages == []


def test_with_an_environment_replies_without_tool_calls_are_actions():
    spec = EnvSpec(path="agentic_fixtures", name="CountdownEnv", kwargs={"start": 2})
    episode = Episode(EpisodeSpec(env=spec, tools=TOOLS, observation_template="[{observation}]"))
    first = episode.reset(3, {"prompt": "p"})
    assert first.messages == [{"role": "user", "content": "[count 2]"}]
    tool_turn = episode.act(call("calculator", expression="2 - 1"))
    assert tool_turn.messages[0]["content"] == "1" and not tool_turn.done and tool_turn.reward == 0.0
    step = episode.act("down")
    assert step.messages == [{"role": "user", "content": "[count 1]"}] and not step.done
    last = episode.act("down")
    assert last.done and last.reward == 1.0 and last.success is True and last.messages == []


def test_the_config_names_unknown_tools_envs_and_agents_before_running_anything(tmp_path):
    config = AgenticConfig(
        env=EnvSpec(gem="game:GuessTheNumbr-v0-easy"),
        tools=(ToolSpec(builtin="pythn"), ToolSpec(path=str(tmp_path / "gone.py"), name="f")),
    )
    problems = config.problems()
    assert len(problems) == 3
    assert "agentic.env.gem='game:GuessTheNumbr-v0-easy'" in problems[0] and "GuessTheNumber" in problems[0]
    assert "agentic.tools[0].builtin='pythn' is unknown; choose one of calculator, python" in problems[1]
    assert problems[2].startswith("agentic.tools[1].path=")
    with pytest.raises(ValueError, match="agentic needs an `env`, `tools` or an `agent`"):
        AgenticConfig()


def test_a_stateful_tool_lives_one_trajectory_with_the_rows_arguments_and_its_reward(tmp_path):
    log = tmp_path / "lifecycle.log"
    tool = ToolSpec(path="agentic_fixtures", name="CounterTool", kwargs={"log": str(log)})
    spec = EpisodeSpec(env=None, tools=(tool,))
    first, second = Episode(spec), Episode(spec)
    row = {"prompt": "p", "extra_info": {"tools_kwargs": {"counter": {"create_kwargs": {"bonus": 0.5}}}}}
    assert first.reset(None, row).tool_reward == 0.5  # created with the row's arguments
    assert second.reset(None, {"prompt": "q", "extra_info": {}}).tool_reward == 0.0  # the tool's own default
    turn = first.act(call("counter", step=2))
    assert turn.messages[0]["content"] == "counted 2" and turn.tool_reward == 2.5  # its own instance's state
    assert second.act(call("counter")).tool_reward == 1.0  # the other trajectory's instance is apart
    final = first.act("done")
    assert final.done and final.tool_reward == 2.5
    first.close()
    second.close()
    events = [line.split() for line in log.read_text().splitlines()]
    assert [event[0] for event in events] == ["create", "create", "release", "release"]
    assert {events[0][1], events[1][1]} == {events[2][1], events[3][1]}  # each instance released once
    assert events[0][2] == "0.5"


def test_the_row_names_its_environment_among_several(tmp_path):
    envs = (
        ("short", EnvSpec(path="agentic_fixtures", name="CountdownEnv", kwargs={"start": 1})),
        ("long", EnvSpec(path="agentic_fixtures", name="CountdownEnv", kwargs={"start": 3})),
    )
    spec = EpisodeSpec(env=None, envs=envs, env_key="game")
    short, long = Episode(spec), Episode(spec)
    assert short.reset(1, {"extra_info": {"game": "short"}}).messages[0]["content"] == "count 1"
    assert long.reset(1, {"extra_info": {"game": "long"}}).messages[0]["content"] == "count 3"
    assert short.act("go").done and not long.act("go").done
    with pytest.raises(ValueError, match=r"extra_info\['game'\]='chess' names no environment of agentic.envs"):
        Episode(spec).reset(1, {"extra_info": {"game": "chess"}})
