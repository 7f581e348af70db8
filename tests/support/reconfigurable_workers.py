"""Test-only workers that load another model into a running group (a new group per model costs seconds of
spawning; a tiny model builds in milliseconds), and measure the resident memory an HF export adds to each rank: the
process's peak RSS (VmHWM, reset just before) over its RSS before the export."""

from __future__ import annotations

import functools
import re

import torch
from lora_tools import LoraTools
from router_tools import RouterTools

from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.protocol import DataProto
from roll_backend.workers.actor import ActorConfig, ActorWorker
from roll_backend.workers.critic import CriticConfig, critic_loss


def _status_bytes(field: str) -> int:
    """A `VmRSS`/`VmHWM` line of /proc/self/status, in bytes."""
    with open("/proc/self/status") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    return int(match.group(1)) * 1024


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return _status_bytes("VmHWM") <= _status_bytes("VmRSS") + (1 << 20)


class ReconfigurableActor(LoraTools, RouterTools, ActorWorker):
    """An ActorWorker whose model and strategy config can be replaced after the group started; with a CriticConfig
    it is a critic (compute_values, critic_train_step)."""

    @register(Dispatch.ONE_TO_ALL)
    def init_model_with(self, config: ActorConfig | CriticConfig) -> None:
        self.config = config
        self.init_model()

    # The critic's train call (workers/critic.py; compute_values is the actor's), so one group per layout serves
    # actor and critic checks.
    @register(Dispatch.DP_MP_DISPATCH_FIRST_BALANCED)
    def critic_train_step(self, batch: DataProto) -> dict[str, float] | None:
        return self.strategy.train_step(batch, functools.partial(critic_loss, self.config.loss))

    @register(Dispatch.ONE_TO_ALL)
    def offload_round_trip(self, parts: list[str]) -> dict:
        """Move `parts` of the model state to host memory and back (the hybrid engine's hand-over): the device bytes
        by part before, while away and after, the bytes each move reported, and whether every tensor of the state
        (params, DDP's grad buffer, the optimizer's moments and main copies) came back bit for bit."""
        from roll_backend.strategies.megatron.offload import ModelStateOffload

        tensors = ModelStateOffload(self.strategy.model, self.strategy.optimizer)
        before_values = {
            (part, i): t.detach().clone()
            for part in ("params", "grads", "optimizer")
            for i, t in enumerate(x for x in tensors.part_tensors(part) if x is not None)
        }
        chosen = frozenset(parts)
        before = self.strategy.model_state_bytes()
        out = self.strategy.move_model_state(chosen, to_host=True)
        away = self.strategy.model_state_bytes()
        back = self.strategy.move_model_state(chosen, to_host=False)
        after_values = {
            (part, i): t.detach()
            for part in ("params", "grads", "optimizer")
            for i, t in enumerate(x for x in tensors.part_tensors(part) if x is not None)
        }
        same = before_values.keys() == after_values.keys() and all(
            torch.equal(before_values[k], after_values[k]) for k in before_values
        )
        return {
            "before": before,
            "away": away,
            "after": self.strategy.model_state_bytes(),
            "out": out,
            "back": back,
            "identical": same,
        }

    @register(Dispatch.ONE_TO_ALL)
    def export_hf_measuring_rss(self, out_dir: str, max_shard_bytes: int) -> dict:
        """{"written": the strategy's export_hf result, "rss_before", "peak_rss": bytes, "peak_reset": whether the
        peak could be reset (else "peak_rss" is the process's all-time peak), "tp", "pp": this rank's place}."""
        peak_reset = reset_peak_rss()
        rss_before = _status_bytes("VmRSS")
        written = self.strategy.export_hf(out_dir, max_shard_bytes=max_shard_bytes)
        return {
            "written": written,
            "rss_before": rss_before,
            "peak_rss": _status_bytes("VmHWM"),
            "peak_reset": peak_reset,
            "tp": self.coords.tp,
            "pp": self.coords.pp,
        }
