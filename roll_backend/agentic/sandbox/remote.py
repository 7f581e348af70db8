"""A remote sandbox: a SandboxFusion-compatible service (verl's choice), `POST {url}/run_code`, behind the same
interface and result type as the local one. The service owns the boundary; this client owns the deadline.

Request: {code, language: python, run_timeout, compile_timeout, memory_limit_MB, stdin: ""}. Response: {status:
Success | Failed | SandboxError, message, run_result: {status: Finished | TimeLimitExceeded | Error, return_code,
stdout, stderr, execution_time}}. Output is capped here as locally (output_bytes per stream).
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request

from roll_backend.agentic.sandbox.limits import SandboxLimits, SandboxResult, SandboxSettings, SandboxUnavailable

ENDPOINT = "/run_code"


class RemoteSandbox:
    """Sends each run to the service; at most `max_concurrent` requests at once from this process."""

    def __init__(self, settings: SandboxSettings):
        self.url = settings.url.rstrip("/") + ENDPOINT
        self.request_timeout_s = settings.request_timeout_s
        self.slots = threading.BoundedSemaphore(settings.max_concurrent)

    def run_python(self, code: str, limits: SandboxLimits, stdin: str = "") -> SandboxResult:
        body = {
            "code": code,
            "language": "python",
            "run_timeout": limits.wall_s,
            "compile_timeout": limits.wall_s,
            "memory_limit_MB": limits.memory_mb,
            "stdin": stdin,
        }
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
        )
        started = time.monotonic()
        deadline_s = limits.wall_s + self.request_timeout_s
        with self.slots:
            try:
                with urllib.request.urlopen(request, timeout=deadline_s) as response:
                    reply = json.loads(response.read())
            except (urllib.error.URLError, TimeoutError, OSError, ValueError) as exc:
                raise SandboxUnavailable(
                    f"the remote sandbox at {self.url} did not answer within {deadline_s:g}s ({exc}); check "
                    "agentic.sandbox.url and that the service runs"
                ) from exc
        return _result(reply, limits, time.monotonic() - started, self.url)


def _result(reply: dict, limits: SandboxLimits, seconds: float, url: str) -> SandboxResult:
    """The service's answer as a SandboxResult (output capped as a local run's)."""
    if not isinstance(reply, dict) or reply.get("status") == "SandboxError":
        message = reply.get("message") if isinstance(reply, dict) else reply
        raise SandboxUnavailable(f"the remote sandbox at {url} failed: {message!r:.300}")
    run = reply.get("run_result") or {}
    cap = limits.output_bytes
    stdout, stderr = (str(run.get(name) or "") for name in ("stdout", "stderr"))
    flooded = len(stdout.encode()) > cap or len(stderr.encode()) > cap
    stdout, stderr = (text.encode()[:cap].decode("utf-8", errors="replace") for text in (stdout, stderr))
    code = run.get("return_code")
    exit_code = int(code) if isinstance(code, (int, float)) and math.isfinite(code) else None
    status = run.get("status")
    error = None
    if status == "TimeLimitExceeded":
        error, exit_code = f"timed out after {limits.wall_s:g}s (wall clock)", None
    elif flooded:
        error = f"output truncated at {cap} bytes"
    elif exit_code:
        last_line = stderr.rstrip().rsplit("\n", 1)[-1].strip()
        error = f"exited with code {exit_code}: {last_line}" if last_line else f"exited with code {exit_code}"
    elif status not in ("Finished", None) or (reply.get("status") == "Failed" and exit_code is None):
        error = f"the remote run ended with {status or reply.get('status')}: {reply.get('message') or ''}".strip()
    return SandboxResult(stdout, stderr, exit_code, seconds, error)
