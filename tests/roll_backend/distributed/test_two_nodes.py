"""Two Ray nodes on this machine (ray.cluster_utils, loopback, 5 CPUs each; issue 15): a TP group never spans
the nodes, a GRPO run spreads its roles over both and runs a step, and losing a node mid-run triggers the
automatic restart, which stops with a clear error because the run no longer fits on the node that is left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline_fixtures import base_config, model_dir, overrides, prompt_file  # noqa: F401  (shared fixtures)

SCRIPT = Path(__file__).resolve().parents[2] / "support" / "two_node_check.py"


def test_two_nodes_placement_grpo_step_and_node_loss(base_config, prompt_file, model_dir, tmp_path):
    output_dir = tmp_path / "run"
    run_overrides = overrides(
        prompt_file,
        model_dir,
        output_dir,
        "max_steps=3",
        "checkpoint.save_steps=1",
        "algorithm.ppo_mini_batch_size=16",
        "fault_tolerance.max_restarts=1",
        "fault_tolerance.inject=hang:actor_infer:0:generate:2",
        # Model loading keeps the default start-up deadline (a loaded machine took over 30 s to start vLLM); only
        # the wait for resources is short, so the rebuild on the one node left gives up quickly.
        # A placement group that fits is granted at once, whatever the load: 6 s is ample for one that will.
        "fault_tolerance.timeouts.generate=8",  # (a generate of this run takes 1-3 s; the hung one waits this out)
        "fault_tolerance.timeouts.placement=6",
        "actor_train.num_cpus_per_rank=2",
        "actor_infer.num_cpus_per_rank=2",
        "reference.num_cpus_per_rank=2",
        "reward.num_cpus_per_rank=1",
    )
    spec = {"config": str(base_config), "overrides": run_overrides, "output_dir": str(output_dir)}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), json.dumps(spec)],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=900,
    )
    (tmp_path / "check.log").write_text(
        done.stdout + "\n--- stderr ---\n" + done.stderr
    )  # kept by pytest: why it failed
    result_lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert result_lines, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads(result_lines[-1].removeprefix("RESULT "))
    head, worker = result["nodes"]

    # TP blocks: ranks 0,1 share a node, ranks 2,3 share a node, and the two blocks use both nodes.
    rank_nodes = result["probe_rank_nodes"]
    assert rank_nodes[0] == rank_nodes[1] and rank_nodes[2] == rank_nodes[3] and rank_nodes[0] != rank_nodes[2]

    # The GRPO run used both nodes, its TP=2 actor on one of them, and step 1 ran there.
    by_role = {name.rsplit(".", 1)[-1]: nodes for name, nodes in result["nodes_by_role"].items()}
    assert len(by_role["ActorWorker"]) == 2 and len(set(by_role["ActorWorker"])) == 1
    assert {node for nodes in by_role.values() for node in nodes} == {head, worker}
    assert result["steps_written"] == [1]

    # Losing the node restarted the run once; the rebuild did not fit on one node and stopped with a clear error.
    assert any(
        line.startswith("restart 1/1 after") and "The last step logged was 1" in line for line in result["messages"]
    ), result["messages"]
    assert result["error"].startswith("PlacementError: could not reserve"), result["error"]
    assert "Lower the role's world size or resources" in result["error"]
