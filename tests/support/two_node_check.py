"""Runs the two-node checks of tests/roll_backend/distributed/test_two_nodes.py in a fresh process (a
ray.cluster_utils cluster needs its own driver): two Ray nodes on loopback, each with its own CPUs.

argv[1]: JSON {"config": path, "overrides": [...], "output_dir": path}. Prints `RESULT {json}` last."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from roll_backend.distributed.ray_env import apply_ray_env_defaults

apply_ray_env_defaults()
# Ray's temp root (session dirs, the cluster address file) in a private short folder: nothing shared with other Rays.
os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rb2n", dir="/tmp")
os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])

import ray  # noqa: E402
from probe_workers import ProbeWorker  # noqa: E402
from ray.cluster_utils import Cluster as RayCluster  # noqa: E402

from roll_backend.config.loader import load_config  # noqa: E402
from roll_backend.distributed.layout import ParallelLayout  # noqa: E402
from roll_backend.distributed.worker_group import RankResources, WorkerGroup  # noqa: E402
from roll_backend.pipelines import run_with_restarts  # noqa: E402

NODE_CPUS = 5  # per node; the pipeline below needs 9 in all, so it must use both nodes and cannot fit on one


class Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def actor_nodes() -> dict[str, list[str]]:
    """Node ids of the live rank actors of each worker class (every rank's actor is a RankHost; its repr, which Ray
    keeps from the actor's start, names the worker class first)."""
    from ray.core.generated import gcs_pb2

    accessor = ray._private.state.state._connect_and_get_accessor()
    nodes: dict[str, list[str]] = {}
    for raw in accessor.get_actor_table(None, "ALIVE"):
        actor = gcs_pb2.ActorTableData.FromString(raw)
        name = actor.repr_name.split(" ")[0] or actor.class_name
        nodes.setdefault(name, []).append(actor.address.node_id.hex())
    return nodes


def remove_node_after_first_step(cluster: RayCluster, node, output_dir: Path, seen: dict) -> None:
    """Once step 1 and its checkpoint are written (step 2 then hangs by fault injection), drop `node`."""
    while not (output_dir / "checkpoints" / "step_1").is_dir():
        time.sleep(0.5)
    seen["nodes_by_role"] = actor_nodes()
    cluster.remove_node(node, allow_graceful=False)
    seen["removed_at"] = time.monotonic()


def main() -> None:
    spec = json.loads(sys.argv[1])
    node_args = {"num_cpus": NODE_CPUS, "node_ip_address": "127.0.0.1", "include_dashboard": False}
    cluster = RayCluster(initialize_head=True, head_node_args=node_args)
    worker_node = cluster.add_node(**node_args)
    ray.init(address=cluster.address)
    result: dict = {"nodes": [n["NodeID"] for n in ray.nodes() if n["Alive"]]}

    # TP=2 x DP=2 with 2.5 CPUs per rank: one TP block fills a node, so the blocks land on different nodes.
    group = WorkerGroup(ProbeWorker, "tp_blocks", 4, ParallelLayout(tp=2), RankResources(num_cpus=2.5))
    result["probe_rank_nodes"] = [p["node"] for p in group.call(ProbeWorker.placement)]
    group.shutdown()

    messages = Messages()
    logging.getLogger("roll_backend").addHandler(messages)
    output_dir = Path(spec["output_dir"])
    config = load_config(spec["config"], spec["overrides"])
    seen: dict = {}
    threading.Thread(
        target=remove_node_after_first_step, args=(cluster, worker_node, output_dir, seen), daemon=True
    ).start()
    try:
        run_with_restarts(config)
        result["error"] = None
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["stopped_after_removal_s"] = time.monotonic() - seen.get("removed_at", time.monotonic())
    result["nodes_by_role"] = seen.get("nodes_by_role")
    result["messages"] = messages.lines
    metrics = output_dir / "metrics.jsonl"
    result["steps_written"] = (
        [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    )
    ray.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
