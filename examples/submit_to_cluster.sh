#!/usr/bin/env bash
# Submit the demo config to a running Ray cluster through Ray Jobs, and follow it to the end.
# This script starts nothing: it needs a cluster whose dashboard (Jobs API) answers at $ADDRESS.
#
# A cluster on this machine, on loopback only (start it from the venv, so a job's `python` is the venv's;
# the env vars must be set before Ray starts, see roll_backend/distributed/ray_env.py):
#
#   export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
#   PATH="$PWD/.venv/bin:$PATH" ray start --head --node-ip-address=127.0.0.1 --port=6380 \
#       --include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port=8265 --num-cpus=16
#
# and when done, stop that cluster (note: `ray stop` stops every Ray of this user on the machine):
#
#   ray stop
#
# submit validates the config here first (exit 2 with every problem), uploads the current directory as the
# job's working_dir (without .venv, .git, runs/ and what .gitignore lists), runs
# `python -m roll_backend.cli run CONFIG OVERRIDES...` on the cluster, prints the job's log as it grows, and
# exits 0 when the job SUCCEEDED, 1 when it FAILED or was STOPPED. Ctrl-C stops following, not the job.
# The config must lie inside the current directory. A relative output_dir lands in the job's copy of the
# working dir on the cluster: give an absolute (shared) path to keep the metrics and checkpoints.
#
# Usage: examples/submit_to_cluster.sh [ADDRESS] [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."

ADDRESS="${1:-http://127.0.0.1:8265}"
shift || true

.venv/bin/roll-backend submit --address "$ADDRESS" configs/grpo_tiny_cpu.yaml \
    output_dir="$PWD/runs/grpo_tiny_cpu_job" "$@"

# Without following: `--no-wait` prints the job id; then e.g.
#   ray job logs --address "$ADDRESS" --follow <job id>
#   ray job stop --address "$ADDRESS" <job id>
# Plot the reward curve once it is done:
#   .venv/bin/roll-backend plot runs/grpo_tiny_cpu_job
