#!/usr/bin/env bash
# Submit the demo config to a Ray cluster through Ray Jobs, and follow it to the end.
#
# Usage:
#   examples/submit_to_cluster.sh [ADDRESS] [key=value ...]       # a running cluster's dashboard (default
#                                                                  # http://127.0.0.1:8265)
#   examples/submit_to_cluster.sh --start-cluster [key=value ...]  # start a private loopback head, submit, stop it
#
# --start-cluster works on a machine where another Ray already runs: the head gets its own temp dir and a
# free port for everything it binds (GCS, dashboard, the dashboard agent's HTTP and gRPC ports, metrics
# export, runtime-env agent, node and object managers, Ray client), so it never meets the other Ray, whose
# default ports (6379, 8265, 52365, ...) may be taken. A head whose dashboard agent could not bind its port
# answers every submission with "No available agent to submit job"; `roll-backend submit` explains that.
# The head runs in its own process group and is stopped by that group's id at exit (`ray stop` would stop
# every Ray of this user on the machine). With --start-cluster and --no-wait, the job is stopped with the head.
#
# To start a long-lived loopback cluster by hand instead (from the venv, so a job's `python` is the venv's;
# these env vars must be set before Ray starts, see roll_backend/distributed/ray_env.py):
#
#   export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
#   PATH="$PWD/.venv/bin:$PATH" ray start --head --node-ip-address=127.0.0.1 --port=6380 \
#       --include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port=8265 --num-cpus=16 \
#       --dashboard-agent-listen-port=52366 --dashboard-agent-grpc-port=52367 --metrics-export-port=52368 \
#       --runtime-env-agent-port=52369   # pick unused ports when another Ray runs here
#
# submit validates the config and its prompt data here first (exit 2 with every problem), uploads the
# current directory as the job's working_dir (without .venv, .git, runs/ and what .gitignore lists), runs
# `python -m roll_backend.cli run CONFIG OVERRIDES...` on the cluster, prints the job's log as it grows, and
# exits 0 when the job SUCCEEDED, 1 when it FAILED or was STOPPED. Ctrl-C stops following, not the job.
# The config must lie inside the current directory. A relative output_dir lands in the job's copy of the
# working dir on the cluster: give an absolute (shared) path to keep the metrics and checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_BIN="$PWD/.venv/bin"

start_private_head() {
    # Nine free loopback ports, chosen by the kernel (bind to port 0), for the head's listeners.
    read -r GCS DASH CLIENT AGENT_HTTP AGENT_GRPC METRICS RUNTIME_ENV NODE_MANAGER OBJECT_MANAGER < <(
        "$VENV_BIN/python" - <<'EOF'
import socket
sockets = [socket.socket() for _ in range(9)]
for s in sockets:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in sockets))
EOF
    )
    HEAD_TMP="$(mktemp -d /tmp/rbh.XXXXXX)"  # short: Ray's unix socket paths live under it
    export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
    unset RAY_ADDRESS
    # setsid: the head and everything it starts form one process group, stopped together at exit.
    PATH="$VENV_BIN:$PATH" setsid "$VENV_BIN/ray" start --head --block --node-ip-address=127.0.0.1 \
        --port="$GCS" --include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port="$DASH" \
        --ray-client-server-port="$CLIENT" --dashboard-agent-listen-port="$AGENT_HTTP" \
        --dashboard-agent-grpc-port="$AGENT_GRPC" --metrics-export-port="$METRICS" \
        --runtime-env-agent-port="$RUNTIME_ENV" --node-manager-port="$NODE_MANAGER" \
        --object-manager-port="$OBJECT_MANAGER" --temp-dir="$HEAD_TMP" --num-cpus=16 --disable-usage-stats \
        >"$HEAD_TMP/ray_start.log" 2>&1 &
    HEAD_PID=$!
    trap stop_private_head EXIT
    ADDRESS="http://127.0.0.1:$DASH"
    echo "started a private Ray head (pid $HEAD_PID, dashboard $ADDRESS, log $HEAD_TMP/ray_start.log)" >&2
    for _ in $(seq 240); do  # the Jobs API answers once the dashboard is up
        if "$VENV_BIN/python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/api/jobs/', timeout=2)" \
            "$ADDRESS" 2>/dev/null; then
            return
        fi
        kill -0 "$HEAD_PID" 2>/dev/null || { echo "ray start failed; see $HEAD_TMP/ray_start.log" >&2; exit 1; }
        sleep 0.5
    done
    echo "the Jobs API at $ADDRESS did not answer in 120 s; see $HEAD_TMP/ray_start.log" >&2
    exit 1
}

stop_private_head() {
    # A job's entrypoint runs in a session of its own: stop the jobs through the Jobs API first, or they would
    # outlive the head.
    "$VENV_BIN/python" - "$ADDRESS" <<'EOF' || true
import os, shlex, signal, sys, time
from ray.job_submission import JobSubmissionClient
client = JobSubmissionClient(sys.argv[1])
running = [job.submission_id for job in client.list_jobs() if not job.status.is_terminal()]
stopped = set(running)
for job_id in running:
    client.stop_job(job_id)
deadline = time.monotonic() + 30
while running and time.monotonic() < deadline:
    running = [job_id for job_id in running if not client.get_job_status(job_id).is_terminal()]
    time.sleep(0.5)
# A stopped job is marked so once its entrypoint was signalled, maybe before that process is gone (a loaded machine
# tears a large process down slowly): wait for each driver process too, and kill one still running after 30 s.
# (only the jobs stopped here: an earlier job's pid may belong to another process by now) A driver that had not
# connected to Ray yet has no driver_info: its process is found by the job's entrypoint, its command line.
jobs = [job for job in client.list_jobs() if job.submission_id in stopped]
drivers = {int(job.driver_info.pid) for job in jobs if job.driver_info is not None}
entrypoints = [shlex.split(job.entrypoint) for job in jobs]
def running_pid(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False
def command_line(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []
drivers |= {int(pid) for pid in os.listdir("/proc") if pid.isdigit() and command_line(pid) in entrypoints}
deadline = time.monotonic() + 30
while (drivers := {pid for pid in drivers if running_pid(pid)}) and time.monotonic() < deadline:
    time.sleep(0.2)
for pid in drivers:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended meanwhile
        pass
deadline = time.monotonic() + 30
while any(map(running_pid, drivers)) and time.monotonic() < deadline:
    time.sleep(0.1)
EOF
    kill -TERM -- "-$HEAD_PID" 2>/dev/null || true
    for _ in $(seq 20); do kill -0 -- "-$HEAD_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$HEAD_PID" 2>/dev/null || true
    wait "$HEAD_PID" 2>/dev/null || true
    # A killed process runs until the kernel has torn it down: return only when none of the group still runs.
    for _ in $(seq 100); do
        ps -e -o pgid=,stat= | awk -v g="$HEAD_PID" '$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }' || break
        kill -KILL -- "-$HEAD_PID" 2>/dev/null || true
        sleep 0.1
    done
    rm -rf "$HEAD_TMP"
}

if [[ "${1:-}" == "--start-cluster" ]]; then
    shift
    start_private_head
else
    ADDRESS="${1:-http://127.0.0.1:8265}"
    shift || true
fi

"$VENV_BIN/roll-backend" submit --address "$ADDRESS" configs/grpo_tiny_cpu.yaml \
    output_dir="$PWD/runs/grpo_tiny_cpu_job" "$@"

# Without following: `--no-wait` prints the job id; then e.g.
#   ray job logs --address "$ADDRESS" --follow <job id>
#   ray job stop --address "$ADDRESS" <job id>
# Plot the reward curve once it is done:
#   .venv/bin/roll-backend plot runs/grpo_tiny_cpu_job
