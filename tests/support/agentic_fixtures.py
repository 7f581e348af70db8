"""User code for the agentic tests, named by module (tests/support is on the workers' PYTHONPATH): an environment
that counts down and can fail on chosen seeds, and an agent function that talks to the rollout's endpoint twice."""

from __future__ import annotations

import threading
import time


class CountdownEnv:
    """Counts down from `start`, one step per reply; reward 1 at zero. Raises in step() for seeds in `fail_seeds`,
    hangs there for seeds in `hang_seeds`."""

    def __init__(self, start: int = 3, fail_seeds: tuple = (), hang_seeds: tuple = ()):
        self.start, self.fail_seeds, self.hang_seeds = start, tuple(fail_seeds), tuple(hang_seeds)

    def reset(self, seed=None, options=None):
        self.left, self.seed = self.start, seed
        return f"count {self.left}", {"task_prompt": str((options or {}).get("prompt", ""))}

    def step(self, action):
        if self.seed in self.fail_seeds:
            raise RuntimeError(f"countdown broke on seed {self.seed}")
        if self.seed in self.hang_seeds:
            threading.Event().wait()  # never returns: only the step deadline ends it
        self.left -= 1
        done = self.left == 0
        return f"count {self.left}", float(done), done, False, {"success": done}


async def two_turn_agent(task, client, follow_up: str = "and now?"):
    """Asks once, then again with its first reply and a follow-up in the history. Its reward is the length of the
    first reply it saw, so a test can check that the text it got is the decoded sampled tokens."""
    messages = [{"role": "user", "content": task["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    reply = first.choices[0].message.content
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": follow_up}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    return float(len(reply))


class CounterTool:
    """A stateful tool (verl's create / execute / calc_reward / release): an instance per trajectory, created with
    the row's `bonus`; its reward is the bonus plus 1 per call. Writes each create and release to `log` (a file) so a
    test sees the lifecycle across the worker processes."""

    name = "counter"
    description = "Count a call."
    parameters = {"type": "object", "properties": {"step": {"type": "integer"}}, "required": []}

    def __init__(self, log: str, release_seconds: float = 0.0):
        self.log, self.instances, self.release_seconds = log, {}, release_seconds

    def _write(self, line: str) -> None:
        with open(self.log, "a") as f:
            f.write(line + "\n")

    def create(self, instance_id, bonus: float = 0.0):
        self.instances[instance_id] = {"bonus": float(bonus), "calls": 0}
        self._write(f"create {instance_id} {bonus}")

    def execute(self, instance_id, step: int = 1):
        self.instances[instance_id]["calls"] += step
        return f"counted {self.instances[instance_id]['calls']}"

    def reward(self, instance_id):
        state = self.instances[instance_id]
        return state["bonus"] + state["calls"]

    def release(self, instance_id):
        del self.instances[instance_id]
        time.sleep(self.release_seconds)  # (a slow release: a sandbox torn down, a connection closed)
        self._write(f"release {instance_id}")
