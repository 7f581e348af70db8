"""The offline pipelines' objectives on the Megatron train strategy (ActorWorker, real Ray/gloo/megatron-core):
SFT, DPO and the reward model's Bradley-Terry loss each take one step at TP1 and at TP2 x PP2 from the same weights
and batch, with the same loss, grad norm and weights after the step (1e-5). The pair losses train through per-row
weights (algorithms.preference.pair_loss_row_weights); their gradient is the pair loss's own: the grad norm of the
DPO step equals that of transformers' model backpropagating the DPO loss on the same pairs, and the reward model's
that of transformers' *ForSequenceClassification backpropagating the Bradley-Terry loss.

The batch has pairs whose two rows land in different micro-batches (micro_batch_size=2 over 3 pairs interleaved at
TP1; packs of 24 tokens for DPO and a 26-token budget for the reward model at TP2 x PP2) and uneven prompt and
response lengths."""

from __future__ import annotations

import pytest
import torch
from megatron_batches import make_rl_batch_tensors, max_masked_diff, model_response_log_probs
from reconfigurable_workers import ReconfigurableActor

from roll_backend import keys
from roll_backend.algorithms.preference import bradley_terry_loss, dpo_loss, pair_loss_row_weights
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_reward_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import MegatronTrainConfig, OptimizerSettings
from roll_backend.workers.actor import ActorConfig, ActorLossConfig, ActorWorker
from roll_backend.workers.reward_model import sequence_scores, with_one_more_column

TOL = 1e-5
BETA = 0.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    spec = TinyModelSpec(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, seed=5
    )
    return str(build_tiny_model(tmp_path_factory.mktemp("offline_objectives"), spec))


@pytest.fixture(scope="module")
def pair_tensors() -> dict[str, torch.Tensor]:
    """6 rows = 3 (chosen, rejected) pairs, interleaved."""
    return make_rl_batch_tensors(vocab_size=300, num_rows=6, seed=11)


def _load(group, model_dir: str, objective: str, value_head: bool = False, **batching):
    strategy = MegatronTrainConfig(
        model_path=model_dir,
        micro_batch_size=2,
        value_head=value_head,
        value_head_init="score_head" if value_head else "fresh",  # (a value head loads the reward model's score)
        **batching,
        # Adam's first step moves every weight by about lr * sign(grad); an epsilon above float32 noise keeps
        # near-zero gradients (equal up to rounding between layouts) from moving weights by +-lr apart
        optimizer=OptimizerSettings(lr=1e-2, clip_grad=0.0, eps=1e-4),
    )
    group.call(
        ReconfigurableActor.init_model_with, ActorConfig(strategy=strategy, loss=ActorLossConfig(objective=objective))
    )
    return group


def _weights(group) -> dict[str, tuple]:
    return group.call(ActorWorker.hf_weight_checksums)[0]


def _assert_same_step(reference: dict, got: dict, weights_ref: dict, weights_got: dict) -> None:
    assert got["loss"] == pytest.approx(reference["loss"], abs=TOL)
    assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=TOL, abs=TOL)
    assert weights_got.keys() == weights_ref.keys()
    for name, (shape, total) in weights_ref.items():
        assert weights_got[name][0] == shape, name
        assert weights_got[name][1] == pytest.approx(total, rel=TOL, abs=TOL), name


def _step_at_both_layouts(
    layout_actors, model_dir, objective, batch: DataProto, value_head=False, check=None, **tp2pp2_batching
):
    """(metrics, weights) at TP1 (micro-batches of 2 rows) and TP2 x PP2 (with `tp2pp2_batching`: a token budget or
    packing) after one step on `batch`; `check(group)` runs on TP1 first."""
    results = []
    for name in ("tp1", "tp2pp2"):
        batching = tp2pp2_batching if name == "tp2pp2" else {}
        group = _load(layout_actors[name], model_dir, objective, value_head, **batching)
        if check is not None and name == "tp1":
            check(group)
        metrics = group.call(ActorWorker.train_step, batch)[0]
        results.append((metrics, _weights(group)))
    (ref_metrics, ref_weights), (got_metrics, got_weights) = results
    _assert_same_step(ref_metrics, got_metrics, ref_weights, got_weights)
    return ref_metrics


def test_sft_step_is_layout_independent(layout_actors, model_dir, pair_tensors):
    from megatron_batches import hf_response_log_probs

    batch = DataProto.from_dict(tensors=dict(pair_tensors))
    metrics = _step_at_both_layouts(layout_actors, model_dir, "sft", batch)
    log_probs, _ = hf_response_log_probs(model_dir, pair_tensors)
    mask = pair_tensors[keys.RESPONSE_MASK].float()
    assert metrics["loss"] == pytest.approx(float(-(log_probs * mask).sum() / mask.sum()), abs=TOL)


def _hf_grad_norm(model, loss_of_model) -> float:
    """The global gradient norm of `loss_of_model(model)` over a transformers model's parameters."""
    loss_of_model(model).backward()
    return float(torch.norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])))


def test_dpo_step_is_layout_independent_and_has_the_dpo_gradient(layout_actors, model_dir, pair_tensors):
    mask = pair_tensors[keys.RESPONSE_MASK]
    reference = torch.randn(6, generator=torch.Generator().manual_seed(12))  # the frozen reference's sequence log-probs
    batch = DataProto.from_dict(tensors=dict(pair_tensors))

    def mean_loss(reference_rows, rows):
        return dpo_loss(rows[0::2], rows[1::2], reference_rows[0::2], reference_rows[1::2], BETA).losses.mean()

    def add_weights(group):
        log_probs = group.call(ActorWorker.compute_log_probs, batch).batch[keys.LOG_PROBS]
        _, weights = pair_loss_row_weights((log_probs * mask).sum(-1), lambda rows: mean_loss(reference.double(), rows))
        batch.batch[keys.ROW_LOSS_WEIGHTS] = weights.float()

    # TP2 x PP2 packs rows into 24-token micro-batches: a pair's rows land in different packs
    packed = {"max_tokens_per_microbatch": 24, "use_sequence_packing": True}
    metrics = _step_at_both_layouts(layout_actors, model_dir, "pairwise", batch, check=add_weights, **packed)

    def hf_dpo(model):
        token_log_probs, _ = model_response_log_probs(model, pair_tensors)
        return mean_loss(reference, (token_log_probs * mask).sum(-1))

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert metrics["grad_norm"] == pytest.approx(_hf_grad_norm(hf, hf_dpo), rel=1e-5)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2ForSequenceClassification: its score head gives the value head its weights, so transformers can
    run the same Bradley-Terry step."""
    spec = TinyModelSpec(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, seed=6
    )
    return str(build_tiny_reward_model(tmp_path_factory.mktemp("offline_reward_model"), spec))


def test_reward_model_step_is_layout_independent_and_has_the_bradley_terry_gradient(
    layout_actors, reward_model_dir, pair_tensors
):
    """The value head scores each row at its last response token (one more response column, as the reward_model
    pipeline feeds it); padding rows and margins included. The step's grad norm equals that of transformers'
    *ForSequenceClassification backpropagating the same Bradley-Terry loss (its score read at each row's last real
    token)."""
    batch = with_one_more_column(DataProto.from_dict(tensors=dict(pair_tensors)))
    batch.batch[keys.PROMPTS] = pair_tensors[keys.PROMPTS]
    margins = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    scores_before = {}

    def add_weights(group):
        values = group.call(ActorWorker.compute_values, batch).batch[keys.VALUES]
        scores = sequence_scores(values, batch.batch[keys.RESPONSE_MASK])
        scores_before["tp1"] = scores
        _, weights = pair_loss_row_weights(
            scores, lambda rows: bradley_terry_loss(rows[0::2], rows[1::2], margins).mean()
        )
        batch.batch[keys.ROW_LOSS_WEIGHTS] = weights.float()

    budget = {"max_tokens_per_microbatch": 26}  # TP2 x PP2: micro-batches of at most 26 padded tokens
    metrics = _step_at_both_layouts(
        layout_actors, reward_model_dir, "pairwise", batch, value_head=True, check=add_weights, **budget
    )

    def hf_bradley_terry(model):
        tensors = pair_tensors
        scores = model(
            input_ids=tensors[keys.INPUT_IDS],
            attention_mask=tensors[keys.ATTENTION_MASK],
            position_ids=tensors[keys.POSITION_IDS],
        ).logits[:, 0]
        return bradley_terry_loss(scores[0::2], scores[1::2], margins.float()).mean()

    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(reward_model_dir, dtype=torch.float32)
    assert metrics["grad_norm"] == pytest.approx(_hf_grad_norm(hf, hf_bradley_terry), rel=1e-5)
    # the scores moved the way the loss asks: each chosen row's score rose against its rejected row
    group = layout_actors["tp2pp2"]
    after = sequence_scores(
        group.call(ActorWorker.compute_values, batch).batch[keys.VALUES], batch.batch[keys.RESPONSE_MASK]
    )
    before = scores_before["tp1"]
    assert ((after[0::2] - after[1::2]) > (before[0::2] - before[1::2])).all()
    assert max_masked_diff(after, before, torch.ones_like(after)) > 1e-3
