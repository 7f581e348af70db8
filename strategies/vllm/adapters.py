"""LoRA adapters served by a vLLM engine over its base weights (actor_train.strategy.lora.sync: adapter): each weight
sync brings the trainer's adapters as PEFT-named tensors; they are written as a PEFT folder (vLLM loads adapters from
folders) on a memory-backed file system where there is one, loaded under a new name and id, and every request from
then on carries that LoRARequest. The previous adapter is removed (one slot: max_loras=1). vLLM keys its prefix cache
by adapter name, so blocks computed under older adapters are never reused."""

from __future__ import annotations

import itertools
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

# The ranks vLLM's LoRA config accepts for max_lora_rank (vllm/config/lora.py).
SERVED_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def served_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds adapters of `rank`."""
    for served in SERVED_RANKS:
        if served >= rank:
            return served
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank ({SERVED_RANKS[-1]})")


class AdapterSlot:
    """The adapter an engine serves now (`request`, None before the first load) and its folder; the one before it
    (`previous`: its request and the trainer version it was) stays on disk until the next load, so a sync whose probe
    fails can be undone (`revert`)."""

    def __init__(self, llm):
        self.llm = llm
        self.request = None
        self.previous: tuple | None = None  # (LoRARequest, version) of the adapter served before the last load
        self.ids = itertools.count(1)
        shm = Path("/dev/shm")
        self.root = Path(tempfile.mkdtemp(prefix="roll-lora-", dir=shm if shm.is_dir() else None))
        weakref.finalize(self, shutil.rmtree, self.root, True)  # the folders go with the engine's process

    def load(self, tensors: dict[str, torch.Tensor], peft_config, version_before: int | None = None) -> None:
        """Write the adapter (PEFT-named tensors) as a folder and serve it; `version_before`: the trainer version of
        the adapter served until now (what `revert` goes back to)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        number = next(self.ids)
        folder = self.root / f"adapter-{number}"
        folder.mkdir()
        save_file({name: t.contiguous() for name, t in tensors.items()}, folder / "adapter_model.safetensors")
        peft_config.save_pretrained(folder)
        request = LoRARequest(f"policy-{number}", number, str(folder))
        if self.previous is not None:  # two loads back: no longer needed for an undo
            shutil.rmtree(self.previous[0].lora_path, ignore_errors=True)
        self.previous = None if self.request is None else (self.request, version_before)
        self._serve(request)

    def previous_version(self) -> int | None:
        """The trainer version of the adapter `revert` goes back to. Raises RuntimeError when there is none (no load
        yet, only one, or undone already)."""
        if self.previous is None:
            raise RuntimeError(
                "no adapter sync to undo: the engine loaded at most one adapter, or the last sync was undone already"
            )
        return self.previous[1]

    def revert(self) -> None:
        """Serve the adapter of before the last load again (its probe failed)."""
        self.previous_version()  # (raises when there is nothing to undo)
        (request, _), undone = self.previous, self.request
        self.previous = None
        self._serve(request)
        shutil.rmtree(undone.lora_path, ignore_errors=True)

    def _serve(self, request) -> None:
        """`request`'s adapter in the engine's one slot, in place of the one served now."""
        engine = self.llm.llm_engine
        if self.request is not None:
            engine.remove_lora(self.request.lora_int_id)
        self.request = request
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the LoRA adapter written to {request.lora_path}")
