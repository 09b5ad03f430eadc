"""Train/inference mismatch metrics and truncated importance-sampling weights (aligner.rl.mismatch)
against float64 loops."""
from __future__ import annotations

import math

import pytest
import torch

from aligner.rl import mismatch as X

LENGTHS = [7, 2, 1, 5]
T = 7


def make_mask(lengths=LENGTHS, width=T) -> torch.Tensor:
    return torch.arange(width) < torch.tensor(lengths).unsqueeze(-1)  # [B, T] bool


def logprob_pair(seed: int, noise: float = 0.1, dtype=torch.float32):
    """(trainer, engine) logprobs [B, T]: the engine's perturbed by `noise`; nan / -inf off the mask."""
    generator = torch.Generator().manual_seed(seed)
    mask = make_mask()
    trainer = -torch.rand(len(LENGTHS), T, generator=generator, dtype=torch.float64) * 4
    engine = trainer + torch.randn(len(LENGTHS), T, generator=generator, dtype=torch.float64) * noise
    return (torch.where(mask, trainer, math.nan).to(dtype), torch.where(mask, engine, -math.inf).to(dtype))


def token_log_ratios(trainer, engine, lengths=LENGTHS) -> list[list[float]]:
    return [[float(trainer[b, t]) - float(engine[b, t]) for t in range(n)] for b, n in enumerate(lengths)]


def test_mismatch_metrics_match_loops():
    trainer, engine = logprob_pair(seed=0, noise=0.3)
    metrics = X.mismatch_metrics(trainer, engine, make_mask())
    log_ratios = [x for row in token_log_ratios(trainer, engine) for x in row]
    ratios = [math.exp(x) for x in log_ratios]
    expected = {
        "mismatch_kl": sum(math.exp(x) - 1 - x for x in log_ratios) / len(log_ratios),
        "mismatch_ratio_mean": sum(ratios) / len(ratios), "mismatch_ratio_max": max(ratios),
        "mismatch_ratio_min": min(ratios), "mismatch_abs_logprob_diff_max": max(abs(x) for x in log_ratios),
    }
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-12), key
        assert isinstance(metrics[key], float)


def test_identical_logprobs_have_no_mismatch():
    trainer, _ = logprob_pair(seed=1)
    metrics = X.mismatch_metrics(trainer, trainer.clone(), make_mask())
    assert metrics == {"mismatch_kl": 0.0, "mismatch_ratio_mean": 1.0, "mismatch_ratio_max": 1.0,
                       "mismatch_ratio_min": 1.0, "mismatch_abs_logprob_diff_max": 0.0}
    for level in X.TIS_LEVELS:
        weights = X.truncated_importance_weights(trainer, trainer.clone(), make_mask(), level, cap=2.0)
        assert weights.tolist() == make_mask().float().tolist()


def test_k3_keeps_tiny_differences():
    trainer = torch.tensor([[-1.0, -2.0]], dtype=torch.float32)
    engine = trainer + torch.tensor([[1e-4, -1e-4]])
    metrics = X.mismatch_metrics(trainer, engine, torch.ones(1, 2, dtype=torch.bool))
    diffs = [float(trainer[0, t]) - float(engine[0, t]) for t in range(2)]  # float32's rounding of 1e-4
    assert metrics["mismatch_kl"] == pytest.approx(sum(d * d / 2 for d in diffs) / 2, rel=1e-3)


def test_mismatch_group_path_equals_the_local_one(world_group):
    trainer, engine = logprob_pair(seed=2)
    assert X.mismatch_metrics(trainer, engine, make_mask(), group=world_group) == \
        X.mismatch_metrics(trainer, engine, make_mask())


@pytest.mark.parametrize("level", X.TIS_LEVELS)
@pytest.mark.parametrize("cap", [1.05, 1.3])
def test_truncated_importance_weights_match_loops(level, cap):
    trainer, engine = logprob_pair(seed=3, noise=0.3)
    weights = X.truncated_importance_weights(trainer, engine, make_mask(), level, cap)
    assert weights.dtype == torch.float32 and not weights.requires_grad
    capped = 0
    for b, row in enumerate(token_log_ratios(trainer, engine)):
        for t in range(T):
            if t >= len(row):
                assert float(weights[b, t]) == 0.0
                continue
            ratio = math.exp(sum(row)) if level == "sequence" else math.exp(row[t])
            capped += ratio > cap
            assert float(weights[b, t]) == pytest.approx(min(ratio, cap), rel=1e-6), (b, t)
    assert 0 < capped < int(make_mask().sum())  # the cap binds on some tokens, not on all


def test_sequence_weights_of_a_long_sequence_cannot_overflow():
    mask = torch.ones(2, 4000, dtype=torch.bool)
    trainer = torch.zeros(2, 4000)
    engine = torch.stack([torch.full((4000,), -0.05), torch.full((4000,), 0.05)])  # summed log-ratio +-200
    weights = X.truncated_importance_weights(trainer, engine, mask, "sequence", cap=3.0)
    assert torch.isfinite(weights).all()
    assert bool((weights[0] == 3.0).all())  # exp(200) would be inf in float32: capped
    assert 0.0 <= float(weights[1].min()) and float(weights[1].max()) < 1e-30  # exp(-200), below float32's range
    weights = X.truncated_importance_weights(trainer.double(), engine.double(), mask, "sequence", cap=3.0)
    assert weights.dtype == torch.float64 and float(weights[1, 0]) == pytest.approx(math.exp(-200), rel=1e-9)


def test_mismatch_errors():
    trainer, engine = logprob_pair(seed=4)
    with pytest.raises(ValueError, match="unknown truncated importance sampling level 'row'; choose one of token, "
                                         "sequence"):
        X.truncated_importance_weights(trainer, engine, make_mask(), "row", cap=2.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        X.truncated_importance_weights(trainer, engine, make_mask(), "token", cap=0.0)
    with pytest.raises(ValueError, match="mask is empty"):
        X.mismatch_metrics(trainer, engine, torch.zeros_like(make_mask()))
    with pytest.raises(ValueError, match="engine logprobs shape"):
        X.mismatch_metrics(trainer, engine[:, :3], make_mask())
