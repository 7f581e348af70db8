"""Writing a Hugging Face checkpoint folder from gathered weights: safetensors shards written as the tensors arrive
(the writer holds about one shard at a time), their index, the config (a value-head model's as
*ForSequenceClassification) and the tokenizer files. No Megatron import."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# 5 GiB, about transformers 4's default shard size (5.x writes up to 50GB): the writing rank holds one shard in host
# memory, so the shard size bounds what the export adds to that rank's memory.
DEFAULT_MAX_SHARD_BYTES = 5 << 30
SINGLE_FILE = "model.safetensors"  # the whole model in one file: no index (as transformers writes it)
INDEX_FILE = "model.safetensors.index.json"
_SHARD_GLOB = "model-?????-of-?????.safetensors"
_TEMP_DIR = ".export-shards"  # shards are written here under temporary names, moved into place at the end


def shard_name(index: int, count: int) -> str:
    """transformers' name of shard `index` (1-based) of `count`."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


@dataclass(frozen=True)
class WrittenWeights:
    """What a ShardedSafetensorsWriter wrote."""

    files: tuple[str, ...]  # weight files in the folder, in order
    total_size: int  # bytes of tensor data (the index's metadata.total_size)
    num_tensors: int
    peak_held_bytes: int  # most tensor bytes the writer held at once


class ShardedSafetensorsWriter:
    """Writes named tensors to safetensors shards of at most `max_shard_bytes` (a larger tensor gets a shard of its
    own) as they are added: a shard is written once the next tensor would not fit, so at most one shard's tensors
    are held. `close` names the shards as transformers does, one `model.safetensors` when a single shard was
    written, else `model-0000i-of-0000N.safetensors` and `model.safetensors.index.json`, and removes weight files
    of an earlier export in the folder (transformers would load a stale `model.safetensors` before an index)."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes={max_shard_bytes} must be > 0 (bytes of tensor data per shard file)")
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._temp_dir = self.out_dir / _TEMP_DIR
        shutil.rmtree(self._temp_dir, ignore_errors=True)  # left by an export that did not finish
        self._temp_dir.mkdir(parents=True)
        self._shard: dict[str, torch.Tensor] = {}
        self._held = 0
        self._peak = 0
        self._total = 0
        self._shard_of: dict[str, int] = {}  # tensor name -> shard number (0-based)
        self._shards_written = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Take one tensor (copied to CPU); writes the current shard first when this one would not fit in it."""
        if name in self._shard_of:
            raise ValueError(f"tensor {name!r} was added twice to the export in {self.out_dir}")
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if self._shard and self._held + nbytes > self.max_shard_bytes:
            self._write_shard()
        self._shard[name] = tensor
        self._shard_of[name] = self._shards_written
        self._held += nbytes
        self._total += nbytes
        self._peak = max(self._peak, self._held)

    def _write_shard(self) -> None:
        from safetensors.torch import save_file

        save_file(self._shard, str(self._temp_path(self._shards_written)), metadata={"format": "pt"})
        self._shards_written += 1
        self._shard, self._held = {}, 0

    def _temp_path(self, shard: int) -> Path:
        return self._temp_dir / f"shard-{shard:05d}.safetensors"

    def close(self) -> WrittenWeights:
        """Write the last shard, move the shards to their final names and write the index (when sharded)."""
        if self._shard or not self._shards_written:
            self._write_shard()  # (an empty model still gets its one, empty, file)
        count = self._shards_written
        names = [SINGLE_FILE] if count == 1 else [shard_name(i + 1, count) for i in range(count)]
        for stale in [self.out_dir / SINGLE_FILE, self.out_dir / INDEX_FILE, *self.out_dir.glob(_SHARD_GLOB)]:
            stale.unlink(missing_ok=True)
        for shard, name in enumerate(names):
            os.replace(self._temp_path(shard), self.out_dir / name)
        if count > 1:
            index = {
                "metadata": {"total_size": self._total},
                "weight_map": {tensor: names[shard] for tensor, shard in sorted(self._shard_of.items())},
            }
            temp_index = self._temp_dir / INDEX_FILE
            temp_index.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            os.replace(temp_index, self.out_dir / INDEX_FILE)
        self._temp_dir.rmdir()
        return WrittenWeights(tuple(names), self._total, len(self._shard_of), self._peak)


def sequence_classification_config(hf_config, tokenizer_dir: str | Path):
    """A copy of `hf_config` for a value-head model exported as transformers' <Model>ForSequenceClassification with
    one label (the value head is its `score` head): what AutoModelForSequenceClassification and a RewardModelWorker
    (value_head_init=score_head) load. transformers reads a score at the last token that is not `pad_token_id`, so a
    config without one takes the tokenizer's."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    class_name = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(hf_config.model_type)
    if class_name is None:
        raise ValueError(
            f"model_type={hf_config.model_type!r} has no *ForSequenceClassification class in transformers "
            f"{transformers.__version__}, so its value head cannot be exported as a score head; export a model "
            "type that has one (e.g. qwen2, qwen3, llama)"
        )
    config = copy.deepcopy(hf_config)
    config.architectures = [class_name]
    config.num_labels = 1
    if config.pad_token_id is None:
        config.pad_token_id = _tokenizer_pad_token_id(Path(tokenizer_dir))
    if config.pad_token_id is None:
        logger.warning(
            "exporting a %s without pad_token_id (neither the config nor the tokenizer in %s has one): transformers "
            "scores only one sequence per batch with it; set pad_token_id in the exported config.json",
            class_name,
            tokenizer_dir,
        )
    return config


def _tokenizer_pad_token_id(tokenizer_dir: Path) -> int | None:
    if not any((tokenizer_dir / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir).pad_token_id


_TOKENIZER_AND_GENERATION_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
    "added_tokens.json",
)


def copy_tokenizer_and_generation_config(src: str | Path, dst: str | Path) -> None:
    """The tokenizer and generation-config files of the model folder `src` that exist, copied to `dst`."""
    src, dst = Path(src), Path(dst)
    for name in _TOKENIZER_AND_GENERATION_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
