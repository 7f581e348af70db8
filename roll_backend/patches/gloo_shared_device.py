"""One gloo TCP device per process, shared by every gloo process group, instead of one device per group.

Each gloo TCP device runs an event-loop thread that wakes every 10 ms whether or not anything is sent
(pytorch/gloo#246). torch creates a device per process group, and megatron-core creates about twenty groups per
rank, so an idle CPU rank spent ~4% of a core polling, and bench/grpo_step.py's four idle ranks took ~7% of a
2-core machine from the phase that was running. gloo's device is
built to serve many process groups: pairs of every context share its listening socket and loop. Sharing one
device per process leaves one polling thread.

Applied in each process before it creates gloo groups (CPU ranks, the vLLM rollout on CPU); torch picks the
device's interface as it does by default (GLOO_SOCKET_IFNAME, else the hostname's address).
"""

from __future__ import annotations

import datetime
import functools
import logging

logger = logging.getLogger(__name__)

TESTED_TORCH_VERSIONS = ("2.13",)


@functools.cache
def shared_device():
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    return ProcessGroupGloo.create_default_device()


def apply() -> None:
    """Make torch.distributed's gloo groups use `shared_device()` (idempotent)."""
    import torch
    from torch.distributed import distributed_c10d

    gloo = distributed_c10d.ProcessGroupGloo
    if getattr(gloo, "shares_one_device", False):
        return
    if not torch.__version__.startswith(TESTED_TORCH_VERSIONS):
        logger.warning(
            "the shared gloo device is tested on torch %s, found %s", TESTED_TORCH_VERSIONS, torch.__version__
        )

    class SharedDeviceProcessGroupGloo(gloo):
        """ProcessGroupGloo(store, rank, size, timeout=...) as torch's group factory calls it, on the shared device."""

        shares_one_device = True

        def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta = datetime.timedelta(minutes=30)):
            options = gloo._Options()
            options._devices = [shared_device()]
            options._timeout = timeout
            options._threads = 2  # what torch gives a one-device group
            super().__init__(store, rank, size, options)

    distributed_c10d.ProcessGroupGloo = SharedDeviceProcessGroupGloo
