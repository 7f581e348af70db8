"""`roll-backend submit` against a Jobs API that has no agent: the answer Ray gives is turned into what to do."""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import ray

from roll_backend import cli

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "grpo_tiny_cpu.yaml"
# Ray's Jobs API (ray/dashboard/modules/job/job_head.py) answers a submission with this text and status 500
# when no node's dashboard agent responds, e.g. when the agent could not bind its port.
RAY_NO_AGENT_TEXT = "No available agent to submit job, please try again later."


class NoAgentJobsApi(BaseHTTPRequestHandler):
    """The head's side of the Jobs API as JobSubmissionClient sees it when the agent is missing."""

    submissions: list[dict] = []

    def _reply(self, status: int, body: str, content_type: str = "application/json") -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/api/version":
            self._reply(200, json.dumps({"version": "4", "ray_version": ray.__version__, "ray_commit": "x"}))
        elif self.path.startswith("/api/packages/"):
            self._reply(200, "")  # the working dir is "already uploaded": no upload needed
        else:
            self._reply(404, "")

    def do_POST(self):  # noqa: N802
        length = int(self.headers.get("Content-Length", 0))
        NoAgentJobsApi.submissions.append(json.loads(self.rfile.read(length) or b"{}"))
        self._reply(500, RAY_NO_AGENT_TEXT, "text/plain")

    def log_message(self, *args):  # keep the test output quiet
        pass


@pytest.fixture()
def no_agent_api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), NoAgentJobsApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_no_available_agent_becomes_a_message_that_says_what_to_do(no_agent_api, tmp_path, monkeypatch, capsys):
    shutil.copy(CONFIG, tmp_path / "run.yaml")
    monkeypatch.chdir(tmp_path)
    NoAgentJobsApi.submissions.clear()
    assert cli.main(["submit", "--address", no_agent_api, "run.yaml", f"output_dir={tmp_path}/out"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert len(NoAgentJobsApi.submissions) == 1  # the config was valid and the job was really sent
    assert f"roll-backend submit: the cluster at {no_agent_api} accepted the request but has no dashboard agent" in err
    assert "--dashboard-agent-listen-port" in err and "examples/submit_to_cluster.sh --start-cluster" in err
    assert "Traceback" not in err


# ---- examples/submit_to_cluster.sh next to another Ray ----------------------------------------------------
def hold_ports(ports: list[int]) -> list:
    """Bind what is free of `ports` on loopback, as another Ray on this machine would hold its defaults."""
    import socket

    held = []
    for port in ports:
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
            held.append(sock)
        except OSError:  # already taken, which is the point
            sock.close()
    return held


def test_submit_script_starts_its_own_head_beside_another_ray(tmp_path):
    import re
    import subprocess

    # Ray's default GCS, dashboard, dashboard agent, metrics and client ports, all busy.
    held = hold_ports([6379, 8265, 52365, 52366, 8076, 10001])
    try:
        done = subprocess.run(
            [
                "bash",
                str(REPO / "examples" / "submit_to_cluster.sh"),
                "--start-cluster",
                "--no-wait",
                "max_steps=1",
                f"output_dir={tmp_path}/out",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=400,
        )
    finally:
        for sock in held:
            sock.close()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"submitted job \S+ to http://127\.0\.0\.1:\d+", done.stderr), done.stderr
    assert NO_AGENT_FRAGMENT not in done.stderr
    head_pid = int(re.search(r"started a private Ray head \(pid (\d+)", done.stderr).group(1))
    assert live_members_of_group(head_pid) == []  # the script stopped its head's whole process group
    assert live_processes_naming(str(tmp_path)) == []  # and the job, whose entrypoint has a session of its own


def live_processes_naming(text: str) -> list[str]:
    """Running processes whose command line contains `text`."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and state not in "ZX":
            found.append(f"{proc.name}: {cmdline[:120]}")
    return found


def live_members_of_group(pgid: int) -> list[str]:
    """Processes of process group `pgid` that are still running (zombies waiting to be reaped do not count)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, group = fields[0], int(fields[2])
        if group == pgid and state not in "ZX":
            live.append(f"{stat.parent.name} ({state})")
    return live


NO_AGENT_FRAGMENT = "no dashboard agent"
