"""REINFORCE / RLOO math against straightforward float64 loops."""
from __future__ import annotations

import math

import pytest
import torch

from aligner.rl import reinforce_math as R
from aligner.rl.ppo_math import kl_penalty


def _rewards(num_prompts: int, k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(num_prompts * k, generator=generator, dtype=torch.float64)
    rewards[:k] = 1.0  # a group whose samples all got the same reward
    return rewards


def _loop_advantages(rewards: list[float], k: int, baseline: str, normalize: bool, eps: float) -> list[float]:
    out = []
    for start in range(0, len(rewards), k):
        group = rewards[start:start + k]
        mean = sum(group) / k
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (k - 1)) if k > 1 else 0.0
        for i, r in enumerate(group):
            if baseline == "rloo":
                b = sum(group[j] for j in range(k) if j != i) / (k - 1)
            elif baseline == "mean":
                b = mean
            else:
                b = 0.0
            out.append((r - b) / (std + eps) if normalize else r - b)
    return out


@pytest.mark.parametrize("k", [2, 4, 5])
@pytest.mark.parametrize("baseline", ["rloo", "mean", "none"])
@pytest.mark.parametrize("normalize", [False, True])
def test_group_advantages_match_loops(k, baseline, normalize):
    rewards = _rewards(6, k, seed=k)
    got = R.group_advantages(rewards, k, baseline, normalize_by_std=normalize, eps=1e-6)
    expected = torch.tensor(_loop_advantages(rewards.tolist(), k, baseline, normalize, 1e-6), dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    if baseline != "none":
        assert got[:k].abs().max() == 0.0  # a uniform group teaches nothing, normalised or not


def test_leave_one_out_baseline_is_the_mean_of_the_others_and_scaled_group_mean():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 5.0], dtype=torch.float64)
    assert R.leave_one_out_baseline(rewards, 3).tolist() == [0.0, 0.5, 0.5, 4.0, 3.0, 2.0]
    # RLOO's advantage is the group-mean advantage times k / (k - 1).
    torch.testing.assert_close(R.group_advantages(rewards, 3, "rloo"), 1.5 * R.group_advantages(rewards, 3, "mean"))


def test_sequence_rewards_subtract_the_summed_kl_on_the_response_only():
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, 5, generator=generator, dtype=torch.float64)
    reference = -torch.rand(3, 5, generator=generator, dtype=torch.float64)
    lengths = [5, 2, 1]
    mask = torch.tensor([[j < n for j in range(5)] for n in lengths])
    logprobs[1, 3] = float("nan")  # padding may hold anything
    scores = torch.tensor([1.0, 0.0, -2.0], dtype=torch.float64)
    for estimator in ("k1", "k3"):
        kl = kl_penalty(logprobs, reference, estimator, mask)
        got = R.sequence_rewards(scores, kl, mask, kl_coef=0.1)
        expected = []
        for b, n in enumerate(lengths):
            total = 0.0
            for t in range(n):
                log_r = reference[b, t].item() - logprobs[b, t].item()
                total += -log_r if estimator == "k1" else math.exp(log_r) - 1 - log_r
            expected.append(scores[b].item() - 0.1 * total)
        torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_token_advantages_broadcast_the_sequence_advantage_over_its_response():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    got = R.token_advantages(torch.tensor([0.5, -2.0], dtype=torch.float64), mask)
    assert got.tolist() == [[0.5, 0.5, 0.0], [-2.0, 0.0, 0.0]] and got.dtype == torch.float64


def test_bad_groups_and_baselines_are_refused():
    with pytest.raises(ValueError, match="groups of 4"):
        R.group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="at least 2 samples"):
        R.leave_one_out_baseline(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="at least 2 samples"):
        R.group_advantages(torch.zeros(4), 1, "none", normalize_by_std=True)
    with pytest.raises(ValueError, match="unknown baseline 'loo'"):
        R.group_advantages(torch.zeros(4), 2, "loo")
    with pytest.raises(ValueError, match="one value per sample"):
        R.groups(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="scores shape"):
        R.sequence_rewards(torch.zeros(3), torch.zeros(2, 4), torch.ones(2, 4, dtype=torch.bool), 0.1)
