"""The interfaces roles program against: `InferStrategy` (forward only) and `TrainStrategy` (updates weights).

They are separate on purpose: a train strategy also computes log-probs, but it is not an infer strategy;
implementations share code through helper functions (see `megatron_common`), not inheritance.
Every method runs on every rank of the role; results are meaningful on the ranks the dispatch collects
(tp0/cp0/last pipeline stage) and `None` elsewhere.
"""

from __future__ import annotations

import abc
from typing import Callable, Iterator

import torch

from roll_backend.protocol import DataProto

# loss_fn(per_token, micro_batch) -> (loss, metrics). `per_token` holds [B_mb, T_resp] tensors (keys.LOG_PROBS,
# keys.ENTROPY or keys.VALUES) that carry gradients; micro_batch.meta_info[keys.META_GLOBAL_TOKEN_COUNT] is the
# number of loss tokens in the whole DP mini-batch, and the loss must be normalised by it (its sum over
# micro-batches and DP ranks is the step's loss).
LossFn = Callable[[dict[str, torch.Tensor], DataProto], tuple[torch.Tensor, dict[str, float | torch.Tensor]]]


class InferStrategy(abc.ABC):
    """A forward-only backend for one rank of a role."""

    @abc.abstractmethod
    def initialize(self) -> None:
        """Build the model and load its weights; called once after the rank joined its process groups."""

    @abc.abstractmethod
    def compute_log_probs(self, batch: DataProto) -> DataProto | None:
        """Per-token log-probs (and entropy if configured) of `batch`'s responses: keys.LOG_PROBS [B, T_resp]."""

    @abc.abstractmethod
    def compute_values(self, batch: DataProto) -> DataProto | None:
        """Critic values of `batch`'s responses: keys.VALUES [B, T_resp]."""


class TrainStrategy(abc.ABC):
    """A training backend for one rank of a role: forward, backward, optimizer step, checkpoints, weight export."""

    @abc.abstractmethod
    def initialize(self) -> None:
        """Build the model, the optimizer and the scheduler; load the initial weights."""

    @abc.abstractmethod
    def compute_log_probs(self, batch: DataProto) -> DataProto | None:
        """Log-probs under the current weights (e.g. old_log_probs before an update)."""

    @abc.abstractmethod
    def compute_values(self, batch: DataProto) -> DataProto | None:
        """Values under the current weights (critic)."""

    @abc.abstractmethod
    def train_step(self, batch: DataProto, loss_fn: LossFn) -> dict[str, float] | None:
        """One optimizer step over `batch` (split into micro-batches); returns reduced metrics."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, scheduler and RNG state, loadable at another parallel layout."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote."""

    @abc.abstractmethod
    def export_hf(self, out_dir: str) -> None:
        """Write a Hugging Face checkpoint (safetensors, config, tokenizer) that transformers loads."""

    @abc.abstractmethod
    def iter_hf_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named tensors in buckets of at most `bucket_bytes` (a bigger tensor gets its own bucket)."""
