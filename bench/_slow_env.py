"""The environment of bench/agentic_rollout.py: every step takes a set wall time (a tool call, a web request) and
answers a few words; it never ends on its own (the turn limit does)."""

from __future__ import annotations

import time


class SlowEnv:
    def __init__(self, latency_s: float = 0.05):
        self.latency_s = latency_s

    def reset(self, seed=None, options=None):
        self.turn = 0
        return "start the task", {}

    def step(self, action):
        time.sleep(self.latency_s)
        self.turn += 1
        return f"result {self.turn}", 0.0, False, False, {}
