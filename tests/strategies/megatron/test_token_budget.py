"""Token-budget micro-batches, sequence packing and DP balancing on real Megatron actor groups.

At TP1 x DP2 (uneven split: 7 rows, one dispatch padding row, balanced by tokens), TP2, PP2 and CP2, one group per
layout: log-probs with fixed micro-batches, token-budget micro-batches and packing equal transformers' (so the
rows come back in the input order), and one train step from the same checkpoint gives the same loss, grad norm
and post-step log-probs in all three modes.
"""

from __future__ import annotations

import pytest
import torch
from megatron_batches import hf_response_log_probs, max_masked_diff, rl_batch_of_lengths

from roll_backend import keys
from roll_backend.distributed.balance import IMBALANCE_AFTER, IMBALANCE_BEFORE
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.keys import META_BALANCE_DP, META_MAX_TOKENS_PER_MICROBATCH, META_SEQUENCE_PACKING
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import MegatronTrainConfig, OptimizerSettings
from roll_backend.workers.actor import ActorConfig, ActorLossConfig, ActorWorker

TOL = 1e-5
PROMPT_WIDTH, RESPONSE_WIDTH = 10, 24
PROMPT_LENS = [10, 3, 7, 1, 5, 9, 2]
RESPONSE_LENS = [2, 24, 5, 17, 1, 9, 12]  # long-tailed: most short, two long
MODES = {
    "fixed": {},
    "budget": {META_MAX_TOKENS_PER_MICROBATCH: 64},
    "packing": {META_MAX_TOKENS_PER_MICROBATCH: 48, META_SEQUENCE_PACKING: True},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    spec = TinyModelSpec(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    return str(build_tiny_model(tmp_path_factory.mktemp("budget_tiny"), spec))


def _batch_tensors(vocab_size: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses of very uneven lengths."""
    gen = torch.Generator().manual_seed(5)
    return rl_batch_of_lengths(PROMPT_LENS, RESPONSE_LENS, PROMPT_WIDTH, RESPONSE_WIDTH, vocab_size, gen)


@pytest.fixture(scope="module")
def batch_tensors(model_dir) -> dict[str, torch.Tensor]:
    tensors = _batch_tensors(vocab_size=320)
    tensors[keys.OLD_LOG_PROBS], _ = hf_response_log_probs(model_dir, tensors)
    return tensors


def _batch(tensors, mode: str, **meta) -> DataProto:
    return DataProto.from_dict(tensors=tensors, meta_info={**MODES[mode], **meta})


def _log_probs(group, tensors, mode: str, **meta) -> torch.Tensor:
    return group.call(ActorWorker.compute_log_probs, _batch(tensors, mode, **meta)).batch[keys.LOG_PROBS]


@pytest.mark.parametrize(
    "tp,pp,cp,dp", [(1, 1, 1, 2), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1)], ids=["tp1dp2", "tp2", "pp2", "cp2"]
)
def test_fixed_budget_and_packed_micro_batches_agree(make_group, model_dir, batch_tensors, tmp_path, tp, pp, cp, dp):
    config = ActorConfig(
        strategy=MegatronTrainConfig(model_path=model_dir, micro_batch_size=2, optimizer=OptimizerSettings(lr=1e-3)),
        loss=ActorLossConfig(clip_low=0.2),
    )
    group = make_group(
        ActorWorker, tp * pp * cp * dp, ParallelLayout(tp=tp, pp=pp, cp=cp), role="budget", worker_config=config
    )
    group.call(ActorWorker.init_model)
    mask = batch_tensors[keys.RESPONSE_MASK]

    expected = batch_tensors[keys.OLD_LOG_PROBS]
    for mode in MODES:
        got = _log_probs(group, batch_tensors, mode)
        assert max_masked_diff(got, expected, mask) < TOL, mode
    if dp > 1:  # balancing off: the same numbers, the rows in contiguous chunks
        assert (
            max_masked_diff(_log_probs(group, batch_tensors, "budget", **{META_BALANCE_DP: False}), expected, mask)
            < TOL
        )

    group.call(
        ActorWorker.train_step, _batch(batch_tensors, "fixed")
    )  # Adam state exists only after a step: then checkpoint
    start = _log_probs(group, batch_tensors, "fixed")
    checkpoint = str(tmp_path / "start")
    group.call(ActorWorker.save_checkpoint, checkpoint)
    results = {}
    for mode in MODES:
        group.call(ActorWorker.load_checkpoint, checkpoint)
        metrics = group.call(ActorWorker.train_step, _batch(batch_tensors, mode))[0]
        results[mode] = (metrics, _log_probs(group, batch_tensors, "fixed"))
    fixed_metrics, fixed_after = results["fixed"]
    assert max_masked_diff(fixed_after, start, mask) > 1e-3  # the step changed the model
    for mode, (metrics, after) in results.items():
        assert metrics["loss"] == pytest.approx(fixed_metrics["loss"], rel=1e-5, abs=1e-7), mode
        assert metrics["grad_norm"] == pytest.approx(fixed_metrics["grad_norm"], rel=1e-5), mode
        assert max_masked_diff(after, fixed_after, mask) < TOL, mode
        if dp > 1:
            assert metrics[IMBALANCE_AFTER] < metrics[IMBALANCE_BEFORE]


@pytest.mark.gpu(1)
def test_packing_in_thd_format_with_transformer_engine_matches_unpacked(make_group, model_dir, batch_tensors):
    """On a GPU with TransformerEngine, packed rows go through Megatron's THD format (cu_seqlens, no mask)."""
    from roll_backend.distributed.worker_group import RankResources

    config = ActorConfig(
        strategy=MegatronTrainConfig(model_path=model_dir, micro_batch_size=2, transformer_impl="transformer_engine")
    )
    group = make_group(
        ActorWorker,
        1,
        ParallelLayout(),
        role="thd",
        worker_config=config,
        resources=RankResources(num_cpus=1, num_gpus=1),
    )
    group.call(ActorWorker.init_model)
    mask = batch_tensors[keys.RESPONSE_MASK]
    fixed = _log_probs(group, batch_tensors, "fixed")
    assert max_masked_diff(fixed, batch_tensors[keys.OLD_LOG_PROBS], mask) < 1e-3  # TE kernels vs transformers on CPU
    assert max_masked_diff(_log_probs(group, batch_tensors, "packing"), fixed, mask) < 1e-4
