"""The policy losses and aggregations (aligner.rl.policy_losses): value and gradient against float64 loops."""
from __future__ import annotations

import math

import pytest
import torch

from aligner.rl import policy_losses as P

LENGTHS = [6, 3, 1, 4, 5]  # one full row, one single-token row
T = 6
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # DAPO's clip-higher: both ends bind in the batch below
CONSTANT = 8.0  # constant_sum's normaliser


def make_mask(lengths=LENGTHS, width=T) -> torch.Tensor:
    return torch.arange(width) < torch.tensor(lengths).unsqueeze(-1)  # [B, T] bool, right-padded


def policy_batch(seed: int, dtype=torch.float64, spread: float = 0.3):
    """(logprobs, old_logprobs, advantages, weights) [B, T] with garbage (-inf, nan) off the mask."""
    generator = torch.Generator().manual_seed(seed)
    mask = make_mask()
    shape = (len(LENGTHS), T)
    old_logprobs = torch.where(mask, -torch.rand(shape, generator=generator, dtype=dtype) * 3, -math.inf)
    logprobs = old_logprobs + torch.randn(shape, generator=generator, dtype=dtype) * spread  # -inf off mask
    advantages = torch.where(mask, torch.randn(shape, generator=generator, dtype=dtype), math.nan)
    weights = torch.where(mask, torch.rand(shape, generator=generator, dtype=dtype) * 2, math.nan)
    return logprobs, old_logprobs, advantages, weights


# ----------------------------------------------------------------------------- float64 references
def ref_terms(name, logprobs, old_logprobs, advantages, lengths=LENGTHS, clip_low=CLIP_LOW, clip_high=CLIP_HIGH):
    """{(b, t): (loss, d loss / d logprob_t, ratio, clipped)} on the mask, from the formulas of each paper."""
    out = {}
    for b, n in enumerate(lengths):
        log_ratios = [float(logprobs[b, t]) - float(old_logprobs[b, t]) for t in range(n)]
        sequence_ratio = math.exp(sum(log_ratios) / n) if n else 1.0
        for t in range(n):
            advantage, logprob = float(advantages[b, t]), float(logprobs[b, t])
            ratio = sequence_ratio if name == "gspo" else math.exp(log_ratios[t])
            clipped_ratio = min(max(ratio, 1 - clip_low), 1 + clip_high)
            if name == "cispo":
                # -sg(w) A logprob: the gradient is -w A for every token
                out[b, t] = (-clipped_ratio * advantage * logprob, -clipped_ratio * advantage, ratio,
                             clipped_ratio != ratio)
                continue
            unclipped_loss, clipped_loss = -advantage * ratio, -advantage * clipped_ratio
            clipped = clipped_loss > unclipped_loss
            # d(-A r)/d logprob_t = -A r for the token ratio, and -A s_i for GSPO's token form
            # (value s_i, gradient s_i * d logprob_t); the clipped branch is constant.
            out[b, t] = (max(unclipped_loss, clipped_loss), 0.0 if clipped else -advantage * ratio, ratio, clipped)
    return out


def ref_aggregate_weights(aggregation, lengths=LENGTHS, constant=CONSTANT):
    """{(b, t): d batch_loss / d per_token[b, t]}: the weight each token's loss has in the batch loss."""
    tokens, sequences = sum(lengths), sum(1 for n in lengths if n)
    weights = {}
    for b, n in enumerate(lengths):
        for t in range(n):
            weights[b, t] = {"token_mean": 1 / tokens, "sequence_mean_token_mean": 1 / (sequences * n),
                             "sequence_mean_token_sum": 1 / sequences,
                             "constant_sum": 1 / (sequences * constant)}[aggregation]
    return weights


def batch_loss(per_token, mask, aggregation):
    loss_sum, count = P.aggregate_loss(per_token, mask, aggregation, constant_normalizer=CONSTANT)
    return loss_sum / count


# ----------------------------------------------------------------------------- losses
@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("aggregation", P.AGGREGATIONS)
@pytest.mark.parametrize("use_weights", [False, True])
def test_loss_value_and_gradient_match_loops(name, aggregation, use_weights):
    # GSPO's sequence ratio averages the token log-ratios: a wider spread reaches its clip.
    logprobs, old_logprobs, advantages, weights = policy_batch(seed=1, spread=0.8 if name == "gspo" else 0.3)
    logprobs.requires_grad_()
    mask = make_mask()
    terms = P.policy_loss_terms(name, logprobs, old_logprobs, advantages, mask, clip_low=CLIP_LOW,
                                clip_high=CLIP_HIGH, weights=weights if use_weights else None)
    loss = batch_loss(terms.per_token, mask, aggregation)
    loss.backward()

    reference = ref_terms(name, logprobs.detach(), old_logprobs, advantages)
    token_weights = ref_aggregate_weights(aggregation)
    expected_loss = 0.0
    for (b, t), (value, derivative, ratio, clipped) in reference.items():
        tis = float(weights[b, t]) if use_weights else 1.0
        expected_loss += token_weights[b, t] * tis * value
        assert float(terms.per_token[b, t]) == pytest.approx(tis * value, rel=1e-10, abs=1e-12), (b, t)
        assert float(logprobs.grad[b, t]) == pytest.approx(token_weights[b, t] * tis * derivative,
                                                           rel=1e-9, abs=1e-12), (b, t)
        assert float(terms.ratio[b, t]) == pytest.approx(ratio, rel=1e-12), (b, t)
        assert bool(terms.clipped[b, t]) == clipped, (b, t)
    assert float(loss) == pytest.approx(expected_loss, rel=1e-10)

    off = ~mask
    assert float(terms.per_token[off].abs().max()) == 0.0 and bool((terms.ratio[off] == 1.0).all())
    assert not terms.clipped[off].any() and not terms.ratio.requires_grad
    assert float(logprobs.grad[off].abs().max()) == 0.0  # the nan/-inf padding never reaches the gradient
    clipped = [c for (_, _, _, c) in reference.values()]
    assert 0 < sum(clipped) < len(clipped)  # the batch exercises both branches


def test_asymmetric_clip_binds_at_both_ends():
    logprobs, old_logprobs, advantages, _ = policy_batch(seed=2, spread=0.5)
    terms = P.policy_loss_terms("ppo_clip", logprobs, old_logprobs, advantages, make_mask(),
                                clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    ratio, positive = terms.ratio, advantages > 0
    # A > 0: clipped above 1 + clip_high only; A < 0: clipped below 1 - clip_low only.
    mask = make_mask()
    assert bool(terms.clipped[positive & mask].eq(ratio[positive & mask] > 1 + CLIP_HIGH).all())
    assert bool(terms.clipped[~positive & mask].eq(ratio[~positive & mask] < 1 - CLIP_LOW).all())
    assert terms.clipped[positive & mask].any() and terms.clipped[~positive & mask].any()
    # The same ratio between 1 + clip_low and 1 + clip_high is clipped by the symmetric clip, not by clip-higher.
    between = mask & positive & (ratio > 1 + CLIP_LOW) & (ratio <= 1 + CLIP_HIGH)
    assert between.any()
    symmetric = P.policy_loss_terms("ppo_clip", logprobs, old_logprobs, advantages, mask,
                                    clip_low=CLIP_LOW, clip_high=CLIP_LOW)
    assert bool(symmetric.clipped[between].all()) and not terms.clipped[between].any()


def test_gspo_gradient_is_the_sequence_objective_gradient():
    """GSPO's token form gives s_i * A * grad(mean log-ratio): autograd of -A exp(mean log-ratio) in float64."""
    logprobs, old_logprobs, _, _ = policy_batch(seed=3, spread=0.05)  # small moves: no sequence is clipped
    mask = make_mask()
    sequence_advantages = torch.randn(len(LENGTHS), generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    advantages = torch.where(mask, sequence_advantages.unsqueeze(1).expand(-1, T), math.nan)
    logprobs.requires_grad_()
    terms = P.policy_loss_terms("gspo", logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2)
    assert not terms.clipped.any()
    batch_loss(terms.per_token, mask, "sequence_mean_token_mean").backward()

    expected = torch.zeros(len(LENGTHS), T, dtype=torch.float64)
    for b, n in enumerate(LENGTHS):
        row = logprobs.detach()[b, :n].clone().requires_grad_()
        objective = -float(sequence_advantages[b]) * torch.exp((row - old_logprobs[b, :n]).mean()) / len(LENGTHS)
        objective.backward()
        expected[b, :n] = row.grad
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("aggregation", P.AGGREGATIONS)
def test_at_ratio_one_every_loss_is_the_policy_gradient(name, aggregation):
    """The first minibatch after a rollout (logprobs == old): grad = aggregate(-A * grad(logprob))."""
    _, old_logprobs, advantages, _ = policy_batch(seed=5, dtype=torch.float32)
    mask = make_mask()
    logprobs = old_logprobs.clone().requires_grad_()
    terms = P.policy_loss_terms(name, logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.28)
    batch_loss(terms.per_token, mask, aggregation).backward()
    assert not terms.clipped.any() and bool((terms.ratio == 1.0).all())

    expected = torch.zeros(len(LENGTHS), T, dtype=torch.float64)
    for (b, t), weight in ref_aggregate_weights(aggregation).items():
        expected[b, t] = -float(advantages[b, t]) * weight
    torch.testing.assert_close(logprobs.grad.double(), expected, rtol=1e-5, atol=1e-8)


def test_float32_padding_garbage_gives_no_nan():
    logprobs, old_logprobs, advantages, weights = policy_batch(seed=6, dtype=torch.float32)
    logprobs = torch.where(make_mask(), logprobs, math.nan).requires_grad_()
    for name in P.POLICY_LOSSES:
        terms = P.policy_loss_terms(name, logprobs, old_logprobs, advantages, make_mask(), clip_low=0.2,
                                    clip_high=0.2, weights=weights)
        loss = batch_loss(terms.per_token, make_mask(), "token_mean")
        logprobs.grad = None
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all(), name


def test_policy_loss_errors(monkeypatch):
    logprobs, old_logprobs, advantages, _ = policy_batch(seed=7)
    mask = make_mask()
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'; choose one of ppo_clip, gspo, cispo"):
        P.policy_loss_terms("ppo", logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2)
    with pytest.raises(ValueError, match="clip_low and clip_high must be > 0"):
        P.policy_loss_terms("ppo_clip", logprobs, old_logprobs, advantages, mask, clip_low=0.0, clip_high=0.2)
    monkeypatch.setattr(P, "POLICY_LOSSES", dict(P.POLICY_LOSSES))
    with pytest.raises(ValueError, match="'gspo' is already registered"):
        P.register_policy_loss("gspo")(P.gspo)


# ----------------------------------------------------------------------------- aggregation
@pytest.mark.parametrize("aggregation", P.AGGREGATIONS)
def test_aggregate_loss_matches_loop_and_composes_across_micro_batches(aggregation):
    """(sum, count) of micro batches add up to the whole batch's loss, as megatron and the ranks combine them."""
    lengths = [6, 3, 0, 4, 2]  # an empty response: no tokens, and not counted as a sequence
    mask = make_mask(lengths)
    values = torch.randn(len(lengths), T, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    per_token = torch.where(mask, values, math.nan)
    rows = [[float(per_token[b, t]) for t in range(n)] for b, n in enumerate(lengths)]
    nonempty = [row for row in rows if row]
    expected = {
        "token_mean": sum(map(sum, rows)) / sum(lengths),
        "sequence_mean_token_mean": sum(sum(row) / len(row) for row in nonempty) / len(nonempty),
        "sequence_mean_token_sum": sum(sum(row) for row in nonempty) / len(nonempty),
        "constant_sum": sum(map(sum, rows)) / (len(nonempty) * CONSTANT),
    }[aggregation]
    whole = P.aggregate_loss(per_token, mask, aggregation, constant_normalizer=CONSTANT)
    assert float(whole[0] / whole[1]) == pytest.approx(expected, rel=1e-12)
    assert int(whole[1]) == (sum(lengths) if aggregation == "token_mean" else len(nonempty))
    parts = [P.aggregate_loss(per_token[rows], mask[rows], aggregation, constant_normalizer=CONSTANT)
             for rows in (slice(0, 2), slice(2, 3), slice(3, 5))]
    total, count = sum(p[0] for p in parts), sum(p[1] for p in parts)
    assert float(total / count) == pytest.approx(expected, rel=1e-12)


def test_aggregation_errors():
    per_token, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="unknown loss aggregation 'sequence_mean'; choose one of token_mean, "
                                         "sequence_mean_token_mean, sequence_mean_token_sum, constant_sum"):
        P.aggregate_loss(per_token, mask, "sequence_mean")
    for normalizer in (None, 0.0):
        with pytest.raises(ValueError, match="'constant_sum' needs constant_normalizer > 0"):
            P.aggregate_loss(per_token, mask, "constant_sum", constant_normalizer=normalizer)
