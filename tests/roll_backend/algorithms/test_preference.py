"""The offline losses against TRL's own trainers (the installed `trl`): SFT's NLL, the reward model's Bradley-Terry
loss (with margins) and DPO's sigmoid and IPO losses, on the same tensors, float32 to 1e-6. TRL's `compute_loss`
runs unchanged; its model is a stand-in that returns the fixed per-token log-probs / scores of this test, so both
sides see exactly the same numbers. Label smoothing (conservative DPO), which TRL 1.x's sigmoid loss lacks, is
checked as (1 - eps) * TRL(chosen, rejected) + eps * TRL(rejected, chosen). The per-row weights that train a pair
loss equal the pair loss's gradient."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from roll_backend.algorithms.preference import bradley_terry_loss, dpo_loss, pair_loss_row_weights, sft_loss

TOL = 1e-6


class _Accelerator:
    device = torch.device("cpu")
    parallelism_config = None

    def gather_for_metrics(self, tensor):
        return tensor

    gather = gather_for_metrics


def _stub_trainer(trainer_cls, **attrs):
    """A TRL trainer object with only what compute_loss reads (no model loading, no datasets)."""
    stub = object.__new__(trainer_cls)
    stub.__dict__.update(
        accelerator=_Accelerator(),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        aux_loss_enabled=False,
        model=SimpleNamespace(training=True),
        **attrs,
    )
    return stub


class _FixedOutputs:
    """A model stand-in: returns TRL's fused-head outputs built from fixed per-token log-probs [B, T-1]."""

    def __init__(self, log_probs: torch.Tensor, label_mask: torch.Tensor):
        self.outputs = SimpleNamespace(
            log_probs=log_probs * label_mask,
            label_mask=label_mask,
            entropy=torch.zeros_like(log_probs),
            is_top1=torch.zeros_like(label_mask, dtype=torch.bool),
            mean_logits=torch.zeros_like(log_probs),
        )

    def __call__(self, **kwargs):
        return self.outputs


def _token_data(rows: int, width: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    log_probs = -torch.rand(rows, width, generator=generator) * 4
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    return log_probs, mask


def test_sft_loss_equals_trl():
    from trl import SFTTrainer

    log_probs, mask = _token_data(rows=5, width=7, seed=0)
    trainer = _stub_trainer(
        SFTTrainer,
        compute_loss_func=None,
        label_smoother=None,
        args=SimpleNamespace(loss_type="nll", average_tokens_across_devices=False),
    )
    inputs = {"input_ids": torch.zeros(5, 8, dtype=torch.long), "attention_mask": torch.ones(5, 8, dtype=torch.long)}
    reference = trainer.compute_loss(_FixedOutputs(log_probs, mask), inputs)
    assert float(sft_loss(log_probs, mask)) == pytest.approx(float(reference), abs=TOL)
    # A micro-batch's share with the global token count adds up to the mean.
    halves = sft_loss(log_probs[:2], mask[:2], mask.sum()) + sft_loss(log_probs[2:], mask[2:], mask.sum())
    assert float(halves) == pytest.approx(float(reference), abs=TOL)


@pytest.mark.parametrize("with_margin", [False, True])
def test_bradley_terry_equals_trl(with_margin):
    from trl import RewardTrainer

    generator = torch.Generator().manual_seed(1)
    chosen, rejected = torch.randn(6, generator=generator) * 2, torch.randn(6, generator=generator) * 2
    margin = torch.rand(6, generator=generator) if with_margin else None
    trainer = _stub_trainer(RewardTrainer, args=SimpleNamespace(center_rewards_coefficient=None))
    logits = torch.cat([chosen, rejected])[:, None]
    inputs = {"input_ids": torch.zeros(12, 3, dtype=torch.long), "attention_mask": torch.ones(12, 3)}
    if margin is not None:
        inputs["margin"] = margin
    reference = trainer.compute_loss(lambda **kw: SimpleNamespace(logits=logits), inputs)
    assert float(bradley_terry_loss(chosen, rejected, margin).mean()) == pytest.approx(float(reference), abs=TOL)


def _trl_dpo_loss(log_probs, completion_mask, ref_logps, loss_type: str, beta: float) -> torch.Tensor:
    """TRL's DPOTrainer._compute_loss on rows [chosen..., rejected...] with precomputed reference log-probs."""
    from trl import DPOTrainer

    trainer = _stub_trainer(
        DPOTrainer,
        precompute_ref_logps=True,
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
    )
    pairs = log_probs.shape[0] // 2
    # TRL's completion_mask covers the input ids; its shifted part [:, 1:] is the label mask of the log-probs.
    full_mask = torch.cat([torch.zeros(2 * pairs, 1), completion_mask], dim=1).long()
    inputs = {
        "input_ids": torch.zeros_like(full_mask),
        "attention_mask": torch.ones_like(full_mask),
        "completion_mask": full_mask,
        "ref_chosen_logps": ref_logps[:pairs],
        "ref_rejected_logps": ref_logps[pairs:],
    }
    return trainer._compute_loss(_FixedOutputs(log_probs, completion_mask), inputs, return_outputs=False)


@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.1), ("sigmoid", 0.5), ("ipo", 0.1)])
def test_dpo_loss_equals_trl(loss_type, beta):
    log_probs, mask = _token_data(rows=8, width=6, seed=3)
    ref_logps = (log_probs * mask).sum(-1) + torch.randn(8, generator=torch.Generator().manual_seed(4))
    reference = _trl_dpo_loss(log_probs, mask, ref_logps, loss_type, beta)
    sequence = (log_probs * mask).sum(-1)
    ours = dpo_loss(
        sequence[:4],
        sequence[4:],
        ref_logps[:4],
        ref_logps[4:],
        beta,
        loss_type,
        chosen_tokens=mask[:4].sum(-1),
        rejected_tokens=mask[4:].sum(-1),
    )
    assert float(ours.losses.mean()) == pytest.approx(float(reference), abs=TOL)
    assert torch.allclose(ours.chosen_rewards, beta * (sequence[:4] - ref_logps[:4]))


def test_label_smoothing_mixes_trl_losses_of_both_label_orders():
    log_probs, mask = _token_data(rows=8, width=6, seed=5)
    ref_logps = (log_probs * mask).sum(-1) * 0.9
    swapped = torch.cat([torch.arange(4, 8), torch.arange(0, 4)])
    beta, eps = 0.2, 0.15
    forward = _trl_dpo_loss(log_probs, mask, ref_logps, "sigmoid", beta)
    backward = _trl_dpo_loss(log_probs[swapped], mask[swapped], ref_logps[swapped], "sigmoid", beta)
    sequence = (log_probs * mask).sum(-1)
    ours = dpo_loss(sequence[:4], sequence[4:], ref_logps[:4], ref_logps[4:], beta, label_smoothing=eps)
    assert float(ours.losses.mean()) == pytest.approx(float((1 - eps) * forward + eps * backward), abs=TOL)


def test_row_weights_are_the_pair_loss_gradient():
    generator = torch.Generator().manual_seed(6)
    values = torch.randn(10, generator=generator, dtype=torch.float64)
    margin = torch.rand(5, generator=generator, dtype=torch.float64)

    def mean_loss(rows):
        return bradley_terry_loss(rows[0::2], rows[1::2], margin).mean()

    loss, weights = pair_loss_row_weights(values, mean_loss)
    gap = values[0::2] - values[1::2] - margin
    expected = torch.zeros(10, dtype=torch.float64)
    expected[0::2] = -torch.sigmoid(-gap) / 5
    expected[1::2] = torch.sigmoid(-gap) / 5
    assert loss == pytest.approx(float(mean_loss(values)))
    assert torch.allclose(weights, expected)
