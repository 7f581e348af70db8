"""Agent functions users bring, and the OpenAI-compatible loopback endpoint they talk to.

The endpoint runs in the rollout rank (a thread serving 127.0.0.1 only): each trajectory gets its own base URL
(`http://127.0.0.1:PORT/<trajectory>/v1`), so every chat completion an agent asks for is recorded as tokens on that
trajectory. Requests are queued for the rollout loop (agentic.rollout), which owns the engine; the handler thread
waits for the loop's answer. The agent function itself runs in a session_host worker process (`AgentRunner`), many at
once under asyncio, each under `agentic.agent_timeout_s`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import numbers
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from roll_backend.agentic.config import AgentSpec
from roll_backend.agentic.tools import parse_tool_calls
from roll_backend.errors import UserCodeError
from roll_backend.rewards.user_functions import RewardFunctionSpec, load_function


@dataclass
class CompletionRequest:
    """One chat completion an agent asked for, waiting for the rollout loop."""

    trajectory: str
    body: dict
    reply: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class CompletionServer:
    """A loopback HTTP server speaking the OpenAI chat-completions API; requests land in `inbox`, and `doorbell`
    (a Future the loop may wait on) resolves when one arrives."""

    def __init__(self, reply_timeout_s: float):
        self.inbox: queue.Queue[CompletionRequest] = queue.Queue()
        self.reply_timeout_s = reply_timeout_s
        self._lock = threading.Lock()
        self.doorbell: concurrent.futures.Future = concurrent.futures.Future()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                server._handle_post(self)

            def do_GET(self):  # noqa: N802
                _send_json(self, 200, {"object": "list", "data": [{"id": "policy", "object": "model"}]})

            def log_message(self, *args):  # no access log on stderr
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="agent-endpoint", daemon=True)
        self.thread.start()

    def base_url(self, trajectory: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{trajectory}/v1"

    def ring(self) -> concurrent.futures.Future:
        """The doorbell to wait on; a new one once the last has rung."""
        with self._lock:
            if self.doorbell.done():
                self.doorbell = concurrent.futures.Future()
            return self.doorbell

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handle_post(self, handler: BaseHTTPRequestHandler) -> None:
        parts = handler.path.strip("/").split("/")
        if len(parts) < 3 or parts[1:] != ["v1", "chat", "completions"]:
            _send_json(handler, 404, _error(f"unknown path {handler.path}; POST <base_url>/chat/completions"))
            return
        try:
            length = int(handler.headers.get("Content-Length", 0))
            body = json.loads(handler.rfile.read(length) or b"{}")
            if not isinstance(body.get("messages"), list) or not body["messages"]:
                raise ValueError("the request needs a non-empty `messages` list")
        except ValueError as exc:
            _send_json(handler, 400, _error(f"bad request: {exc}"))
            return
        request = CompletionRequest(parts[0], body)
        self.inbox.put(request)
        with self._lock:
            if not self.doorbell.done():
                self.doorbell.set_result(None)
        try:
            status, payload = request.reply.result(timeout=self.reply_timeout_s)
        except concurrent.futures.TimeoutError:
            status, payload = 504, _error("the rollout did not answer in time")
        _send_json(handler, status, payload)


def completion_payload(text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
    """An OpenAI chat.completion for a sampled reply; Hermes `<tool_call>` blocks become `tool_calls`."""
    calls, _ = parse_tool_calls(text)
    message: dict = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{uuid.uuid4().hex[:12]}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
            for call in calls
        ]
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "policy",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error"}}


def _send_json(handler: BaseHTTPRequestHandler, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


# ---- the agent side (in a session_host worker process) --------------------------------------------------------------


class AgentRunner:
    """Runs a user's agent function for many trajectories at once (asyncio), each with its own client."""

    def __init__(self, spec: AgentSpec):
        self.spec = spec
        self.label = f"{spec.path}:{spec.name}"
        self.fn = load_function(RewardFunctionSpec(path=spec.path, name=spec.name))
        if not asyncio.iscoroutinefunction(self.fn):
            raise UserCodeError(f"agent {self.label} must be an `async def` function (it awaits its client)")

    def run_many(self, jobs: list[tuple[dict, str]], timeout_s: float) -> list[dict]:
        """[(task, base_url)] -> [{"reward": float | None} or {"error": message}], in order."""
        return asyncio.run(self._all(jobs, timeout_s))

    async def _all(self, jobs, timeout_s: float) -> list[dict]:
        limit = asyncio.Semaphore(self.spec.concurrency)

        async def bounded(task, url):
            async with limit:
                return await self._one(task, url, timeout_s)

        return list(await asyncio.gather(*(bounded(task, url) for task, url in jobs)))

    async def _one(self, task: dict, url: str, timeout_s: float) -> dict:
        import openai

        client = openai.AsyncOpenAI(base_url=url, api_key="roll-backend", max_retries=0, timeout=timeout_s)
        try:
            value = await asyncio.wait_for(self.fn(task, client, **self.spec.kwargs), timeout_s)
        except TimeoutError:
            return {"error": f"agent {self.label} did not finish within agentic.agent_timeout_s={timeout_s:g}s"}
        except Exception as exc:  # the user's code: its failure ends this trajectory, named
            return {"error": f"agent {self.label} raised {type(exc).__name__}: {exc}"}
        finally:
            await client.close()
        if value is None:
            return {"reward": None}
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            return {"error": f"agent {self.label} returned {value!r}; return a finite number or None"}
        return {"reward": float(value)}
