"""Start or join Ray safely: loopback only, a private short temp dir, the env vars a small CPU machine needs."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import sys
import tempfile
import threading

# Set before Ray first starts (see shared STACK.md): no token auth on local clusters, node on 127.0.0.1,
# readable logs, no telemetry, gloo on loopback.
RAY_ENV_DEFAULTS = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_DEDUP_LOGS": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "GLOO_SOCKET_IFNAME": "lo",
    "TOKENIZERS_PARALLELISM": "false",
    # megatron-core warns at import in every rank that TE/Apex are missing; expected on CPU.
    "PYTHONWARNINGS": "ignore:Transformer Engine and Apex are not installed:UserWarning",
}


# A CPU rank's activations live in host memory, and glibc maps every allocation over 32 MiB fresh and faults its
# pages in again each time: keeping freed memory in the heap instead cut a GRPO step by ~16% on 2 cores
# (bench/grpo_step.py). GPU ranks keep tensors in CUDA's caching allocator and do not need it.
CPU_RANK_ENV_DEFAULTS = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}
VLLM_IPC_ENV = "VLLM_RPC_BASE_PATH"


def cpu_rank_env() -> dict[str, str]:
    """Environment for a CPU rank's process: the allocator defaults above, unless the driver's env sets them."""
    return {key: value for key, value in CPU_RANK_ENV_DEFAULTS.items() if key not in os.environ}


def apply_ray_env_defaults() -> None:
    """Set the Ray/gloo environment defaults without overriding what the user already set."""
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def init_local_ray(
    num_cpus: int = 8,
    num_gpus: int | None = None,
    temp_dir: str | None = None,
    address: str | None = None,
    env_vars: dict[str, str] | None = None,
    cpu_ranks: bool = False,
):
    """Start an in-process Ray on loopback (or join `address` when given) and return ray's context.

    `address="local"` always starts a fresh node: a bare `ray.init()` could attach to whatever cluster
    RAY_ADDRESS or Ray's default temp folder points at. The node's processes inherit this process's environment,
    where the Ray defaults, `env_vars` and, with `cpu_ranks` (every rank of the run on the CPU), the CPU ranks'
    allocator settings go: no job runtime_env and no per-rank one, so Ray hands each actor a worker it started
    ahead instead of starting one per actor (~0.5 s of a core each).
    """
    apply_ray_env_defaults()  # before `import ray`: it reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import
    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        return ray.get_runtime_context()
    if address and address != "local":
        return ray.init(address=address, log_to_driver=True)
    if ray_constants.ENABLE_RAY_CLUSTER and os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
        # ray was imported before the env default was set; apply it to the constant ray read at import,
        # so the local node still listens on loopback only.
        ray_constants.ENABLE_RAY_CLUSTER = False
    # Unix socket paths are limited to ~107 bytes: keep the session dir short.
    temp_dir = temp_dir or tempfile.mkdtemp(prefix="rb", dir="/tmp")
    os.environ.update((cpu_rank_env() if cpu_ranks else {}) | (env_vars or {}))
    # vLLM names its IPC sockets (a TP engine's message queues) under VLLM_RPC_BASE_PATH, the temp dir itself by
    # default, and leaves them when a rank is killed: under the node's own folder they stay with its other files.
    ipc = os.path.join(temp_dir, "vllm_ipc")
    os.makedirs(ipc, exist_ok=True)
    os.environ.setdefault(VLLM_IPC_ENV, ipc)
    return ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        _temp_dir=temp_dir,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
    )


class _NotOnMainThreadNotice(logging.Filter):
    """Drops ray.init's notice that it set no SIGTERM handler off the main thread (start_local_ray sets it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def start_local_ray(**kwargs) -> concurrent.futures.Future:
    """`init_local_ray(**kwargs)` on a thread of its own: Ray's node processes take ~4 s to come up on a 2-core
    machine, mostly waiting, while the caller goes on with its own start-up (imports, building a model); call the
    future's `result()` before the first Ray call. Call from the main thread: it sets the SIGTERM handler ray.init
    sets only there (SIGTERM becomes SystemExit, so the driver's `finally` still shuts Ray down; before Ray is up,
    the process ends at once, as without a handler: a start that hangs, say on a head that went away, must not hold
    the exit, and the node processes it started die with the process)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    if threading.current_thread() is threading.main_thread():
        signal.signal(
            signal.SIGTERM, lambda signum, frame: sys.exit(signum) if future.done() else os._exit(128 + signum)
        )
    logging.getLogger("ray._private.worker").addFilter(_NotOnMainThreadNotice())

    def start() -> None:
        try:
            future.set_result(init_local_ray(**kwargs))
        except BaseException as exc:
            future.set_exception(exc)
            return
        # Ray's node processes die with the thread that started them (its fate sharing is PR_SET_PDEATHSIG, which
        # follows the parent thread): this one stays until the process ends.
        threading.Event().wait()

    threading.Thread(target=start, name="ray-start", daemon=True).start()
    return future
