"""The reward-model role: a sequence score per response from a model with a value head (Megatron forward-only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from roll_backend import keys, roles
from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.protocol import DataProto
from roll_backend.protocol.sequences import at_last_token, last_token_index, place_on_last_token
from roll_backend.rewards.retemplate import retemplated
from roll_backend.workers.strategy_host import StrategyWorker


@dataclass(frozen=True)
class RewardModelConfig:
    """The `reward` role section for a learned reward: an infer strategy whose model ends in a value head."""

    strategy: Any  # e.g. MegatronInferConfig(value_head=True)
    strategy_name: str = "megatron_infer"
    # The reward model's tokenizer is not the policy's (another vocabulary or chat template): it reads the decoded
    # responses after their prompts, rendered with its own template (rewards.retemplate); scores land on the policy's
    # rows. False: it reads the policy's token ids as they are (same tokenizer, the fast path).
    retemplate: bool = False


def with_one_more_column(batch: DataProto) -> DataProto:
    """The batch's sequence columns with one padding column appended on the response side, and each row's column
    right after its last response token attended (a padding token there, out of the loss): the value read at that
    column is the one at the last response token itself (`sequence_scores`), and an attended column is one that
    token-budget and packed micro-batches keep. The token there cannot change the earlier positions (causal)."""
    columns = (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS, keys.RESPONSES, keys.RESPONSE_MASK)
    missing = [name for name in columns if name not in batch.batch.keys()]
    if missing:
        raise KeyError(f"compute_rewards needs the tensor columns {missing}")
    tensors = {name: batch.batch[name] for name in columns}
    extended = {name: torch.cat([t, t.new_zeros(t.shape[0], 1)], dim=1) for name, t in tensors.items()}
    response_mask = tensors[keys.RESPONSE_MASK]
    rows = torch.arange(len(response_mask))
    after_last = (
        extended[keys.INPUT_IDS].shape[1] - extended[keys.RESPONSES].shape[1] + last_token_index(response_mask) + 1
    )
    has_response = response_mask.bool().any(1)
    attention, positions = extended[keys.ATTENTION_MASK], extended[keys.POSITION_IDS]
    attention[rows[has_response], after_last[has_response]] = 1
    positions[rows, after_last] = torch.where(
        has_response, positions[rows, after_last - 1] + 1, positions[rows, after_last]
    )
    return DataProto.from_dict(tensors=extended, meta_info=dict(batch.meta_info))


def sequence_scores(values: torch.Tensor, extended_response_mask: torch.Tensor) -> torch.Tensor:
    """[B] each row's value-head output at its last response token, from the VALUES [B, T_resp + 1] of a batch given
    one more response column (`with_one_more_column`, whose response mask is passed). Critic convention: VALUES[:, j]
    is read where token j is predicted (before it is seen), so VALUES[:, j + 1] is read at token j itself and the
    score sees the whole response."""
    return at_last_token(values[:, 1:], extended_response_mask[:, :-1])


class RewardModelWorker(StrategyWorker):
    """One rank of a reward model. Call `init_model` once after the group starts. `compute_rewards` receives its
    batch by the in-actor broadcast (DP_MP_DISPATCH_FIRST)."""

    def check_config(self) -> None:
        if not getattr(self.config.strategy, "value_head", False):
            raise ValueError("a reward model scores with a value head; set reward.strategy.value_head=True.")

    @register(Dispatch.DP_MP_DISPATCH_FIRST, deadline=roles.REWARD_DEADLINE)
    def compute_rewards(self, batch: DataProto) -> DataProto | None:
        """SEQUENCE_SCORES [B] (the value head at the last response token) and TOKEN_LEVEL_SCORES [B, T_resp]
        (that score on the last response token). None on ranks whose output is not collected."""
        policy_response_mask = batch.batch[keys.RESPONSE_MASK]
        if self.config.retemplate:
            batch = retemplated(batch, self.tokenizer())
        out = self.strategy.compute_values(with_one_more_column(batch))
        if out is None:
            return None
        response_mask = batch.batch[keys.RESPONSE_MASK]
        metrics = out.meta_info.get(keys.META_METRICS) or {}
        counts = {
            name: metrics[name] for name in (keys.METRIC_TOKENS_FORWARDED, keys.METRIC_TOKENS_HELD) if name in metrics
        }
        scores = sequence_scores(out.batch[keys.VALUES], torch.nn.functional.pad(response_mask, (0, 1)))  # [B]
        return DataProto.from_dict(
            tensors={
                keys.SEQUENCE_SCORES: scores,
                keys.TOKEN_LEVEL_SCORES: place_on_last_token(scores, policy_response_mask),
            },
            meta_info={
                keys.META_METRICS: {**counts, "reward_model/score_mean": float(scores.mean()) if len(scores) else 0.0}
            },
        )

    def tokenizer(self):
        """The reward model's own tokenizer (loaded once, from its model folder)."""
        if getattr(self, "_tokenizer", None) is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.config.strategy.model_path)
        return self._tokenizer
