"""Clipped value loss on hand-worked tokens."""

import pytest
import torch

from roll_backend.algorithms import value_loss

NAN = float("nan")

# old values 0, clip 0.5. Per token (l1 = (v-R)^2, l2 = (v_clip-R)^2), gradient 2(v-R) of the winner:
#   v=0.2 R=1   v_clip=0.2  l1=l2=0.64           grad -1.6
#   v=0.8 R=1   v_clip=0.5  l1=0.04 < l2=0.25    clipped: grad 0
#   v=-0.3 R=-1 v_clip=-0.3 l1=l2=0.49           grad 1.4
#   v=0.9 R=0   v_clip=0.5  l1=0.81 > l2=0.25    grad 1.8
#   masked token: NaN
VPREDS = [0.2, 0.8, -0.3, 0.9, NAN]
RETURNS = torch.tensor([[1.0, 1.0, -1.0, 0.0, NAN]])
OLD_VALUES = torch.tensor([[0.0, 0.0, 0.0, 0.0, NAN]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])


def test_value_loss_clipfrac_and_gradient():
    vpreds = torch.tensor([VPREDS], requires_grad=True)
    loss, clipfrac = value_loss(vpreds, RETURNS, OLD_VALUES, MASK, 0.5, "token-mean")
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.25 + 0.49 + 0.81) / 4)
    assert clipfrac.item() == pytest.approx(0.25)
    assert vpreds.grad[0].tolist() == pytest.approx([0.5 * g / 4 for g in (-1.6, 0.0, 1.4, 1.8, 0.0)])


def test_value_loss_aggregation_mode():
    vpreds = torch.tensor([VPREDS])
    loss, _ = value_loss(vpreds, RETURNS, OLD_VALUES, MASK, 0.5, "seq-mean-token-sum-norm")
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.25 + 0.49 + 0.81) / 5)  # divided by T = 5


def test_value_loss_unclipped():
    """clip_range=None (ROLL's value_clip: null): the plain squared error, gradient 2(v-R) on every token."""
    vpreds = torch.tensor([VPREDS], requires_grad=True)
    loss, clipfrac = value_loss(vpreds, RETURNS, OLD_VALUES, MASK, None, "token-mean")
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.04 + 0.49 + 0.81) / 4)
    assert clipfrac.item() == 0.0
    assert vpreds.grad[0].tolist() == pytest.approx([0.5 * g / 4 for g in (-1.6, -0.4, 1.4, 1.8, 0.0)])
