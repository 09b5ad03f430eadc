"""The DPO family's math (aligner.rl.dpo_math) against float64 references written per sample."""
from __future__ import annotations

import math

import pytest
import torch

from aligner.rl import dpo_math as M

LENGTHS = [4, 1, 3, 2]


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def margins(seed: int, n: int = 6, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale)


def test_sequence_logprobs_sum_and_mean_ignore_padding():
    values = torch.randn(len(LENGTHS), 4, generator=torch.Generator().manual_seed(0))
    padded = values.clone()
    for row, n in enumerate(LENGTHS):
        padded[row, n:] = float("nan")  # padding must never leak into a result
    lengths = torch.tensor(LENGTHS)
    summed = M.sequence_logprobs(padded, lengths, average=False)
    averaged = M.sequence_logprobs(padded, lengths, average=True)
    for row, n in enumerate(LENGTHS):
        expected = sum(float(values[row, t]) for t in range(n))
        assert float(summed[row]) == pytest.approx(expected, abs=1e-6)
        assert float(averaged[row]) == pytest.approx(expected / n, abs=1e-6)
    with pytest.raises(ValueError, match="at least one token"):
        M.sequence_logprobs(padded, torch.tensor([4, 0, 3, 2]), average=False)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 0.3])
def test_dpo_and_conservative_dpo(label_smoothing):
    m = margins(1)
    loss = M.dpo_loss(m, label_smoothing)
    for i, x in enumerate(m.tolist()):
        expected = -(1 - label_smoothing) * log_sigmoid(x) - label_smoothing * log_sigmoid(-x)
        assert float(loss[i]) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    with pytest.raises(ValueError, match="label_smoothing"):
        M.dpo_loss(m, 0.5)


def test_dpo_from_logprobs_is_log2_when_policy_equals_reference():
    policy = torch.tensor([-3.2, -1.0, -7.5], dtype=torch.float64)
    for beta in (0.01, 0.1, 1.0, 5.0):
        rewards = M.implicit_rewards(policy, policy.clone(), beta)
        assert torch.equal(rewards, torch.zeros(3, dtype=torch.float64))
        assert torch.allclose(M.dpo_loss(rewards - rewards.flip(0)), torch.full((3,), math.log(2), dtype=torch.float64))


@pytest.mark.parametrize("beta", [0.05, 0.5, 2.0])
def test_ipo(beta):
    m = margins(2)
    loss = M.ipo_loss(m, beta)
    for i, x in enumerate(m.tolist()):
        log_ratio_margin = x / beta
        assert float(loss[i]) == pytest.approx((log_ratio_margin - 1 / (2 * beta)) ** 2, rel=1e-12)


def _bernoulli_kl(p: float, q: float) -> float:
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


@pytest.mark.parametrize("kind", M.RPO_LOSSES)
def test_rpo_losses(kind):
    m, g = margins(3), margins(4, scale=2.0)
    loss = M.rpo_loss(m, g, kind)
    for i, (x, t) in enumerate(zip(m.tolist(), g.tolist())):
        if kind == "rpo_sq":
            expected = 0.5 * (x - t) ** 2
        elif kind == "rpo_fwd_kl":  # from the given-reward preference to the implicit one
            expected = _bernoulli_kl(sigmoid(t), sigmoid(x))
        else:
            expected = _bernoulli_kl(sigmoid(x), sigmoid(t))
        assert float(loss[i]) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # Zero exactly where the implicit preference equals the given one.
    assert torch.allclose(M.rpo_loss(g, g, kind), torch.zeros_like(g), atol=1e-12)


def test_rpo_forward_kl_tends_to_dpo_as_the_given_preference_becomes_certain():
    m = margins(5)
    certain = torch.full_like(m, 40.0)
    assert torch.allclose(M.rpo_loss(m, certain, "rpo_fwd_kl"), M.dpo_loss(m), atol=1e-12)


def test_rpo_is_stable_for_large_margins():
    m = torch.tensor([80.0, -80.0, 200.0], dtype=torch.float32)
    g = torch.tensor([-60.0, 70.0, 0.0], dtype=torch.float32)
    for kind in ("rpo_fwd_kl", "rpo_bwd_kl"):
        assert torch.isfinite(M.rpo_loss(m, g, kind)).all()


def test_preference_loss_dispatch_and_errors():
    m, g = margins(6), margins(7)
    assert torch.equal(M.preference_loss(m, kind="dpo", beta=0.1, label_smoothing=0.1), M.dpo_loss(m, 0.1))
    assert torch.equal(M.preference_loss(m, kind="ipo", beta=0.1), M.ipo_loss(m, 0.1))
    assert torch.equal(M.preference_loss(m, kind="rpo_sq", beta=0.1, target_margin=g), M.rpo_loss(m, g, "rpo_sq"))
    with pytest.raises(ValueError, match="needs given rewards"):
        M.preference_loss(m, kind="rpo_bwd_kl", beta=0.1)
    with pytest.raises(ValueError, match="unknown preference loss"):
        M.preference_loss(m, kind="kto", beta=0.1)
    assert torch.equal(M.sft_loss(m), -m)
