"""The remote sandbox speaks SandboxFusion's /run_code: tested against a loopback service that answers in that
protocol (running each request in the local bubblewrap sandbox, as a SandboxFusion host runs its own), a service that
hangs (the client's deadline), and one that is not there."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from roll_backend.agentic.sandbox import SandboxLimits, SandboxSettings, SandboxUnavailable, make_sandbox
from roll_backend.agentic.tools import PythonCodeTool, ToolBox, ToolCall

LIMITS = SandboxLimits(wall_s=2, cpu_s=2)


class FusionLikeHandler(BaseHTTPRequestHandler):
    requests: list[dict] = []
    hang = threading.Event()  # set: requests wait for `release` (a service that does not answer)
    release = threading.Event()

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        if self.path != "/run_code":
            self.send_error(404)
            return
        if type(self).hang.is_set():
            type(self).release.wait()
            return  # the client gave up long ago: nothing to answer
        local = make_sandbox().run_python(body["code"], SandboxLimits(wall_s=body["run_timeout"], cpu_s=2))
        status = "TimeLimitExceeded" if local.error and local.error.startswith("timed out") else "Finished"
        run = {"status": status, "return_code": local.exit_code, "stdout": local.stdout, "stderr": local.stderr}
        reply = {"status": "Success" if local.exit_code == 0 else "Failed", "message": "", "run_result": run}
        payload = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture(scope="module")
def service():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FusionLikeHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    FusionLikeHandler.release.set()
    server.shutdown()
    server.server_close()  # joins the request threads: nothing of the service outlives the module


def test_runs_come_back_as_local_ones_do(service):
    sandbox = make_sandbox(SandboxSettings(backend="remote", url=service))
    ok = sandbox.run_python("print(6 * 7)", LIMITS)
    assert (ok.stdout, ok.exit_code, ok.error) == ("42\n", 0, None)
    sent = FusionLikeHandler.requests[-1]
    assert sent["language"] == "python" and sent["run_timeout"] == 2 and sent["memory_limit_MB"] == 512
    raised = sandbox.run_python("1 / 0", LIMITS)
    assert raised.exit_code == 1 and raised.error == "exited with code 1: ZeroDivisionError: division by zero"
    slow = sandbox.run_python("import time\ntime.sleep(30)", LIMITS)
    assert slow.error == "timed out after 2s (wall clock)" and slow.exit_code is None
    flood = sandbox.run_python("print('x' * 100000)", SandboxLimits(output_bytes=100))
    assert flood.error == "output truncated at 100 bytes" and len(flood.stdout) == 100


def test_the_python_tool_uses_it(service):
    tool = PythonCodeTool(LIMITS, make_sandbox(SandboxSettings(backend="remote", url=service)))
    result = ToolBox([tool]).execute(ToolCall("python", {"code": "print(sum(range(10)))"}, raw=""))
    assert (result.content, result.error) == ("45", False)


def test_a_hung_or_missing_service_misses_the_deadline_with_a_clear_error(service):
    FusionLikeHandler.hang.set()
    FusionLikeHandler.release.clear()
    try:
        sandbox = make_sandbox(SandboxSettings(backend="remote", url=service, request_timeout_s=0.5))
        started = time.monotonic()
        with pytest.raises(SandboxUnavailable, match=r"did not answer within 1\.5s"):
            sandbox.run_python("print(1)", SandboxLimits(wall_s=1))
        assert time.monotonic() - started < 4  # the client's deadline: the service never answers
    finally:
        FusionLikeHandler.hang.clear()
        FusionLikeHandler.release.set()
    gone = make_sandbox(SandboxSettings(backend="remote", url="http://127.0.0.1:9", request_timeout_s=1))
    with pytest.raises(SandboxUnavailable, match="check agentic.sandbox.url"):
        gone.run_python("print(1)", LIMITS)
