"""REINFORCE / RLOO / GRPO-style math: pure functions on tensors, nothing here touches a model or a config.

A step samples k responses per prompt. Rewards arrive flat, [num_prompts * k], with each prompt's k
samples next to each other (rows p*k .. p*k+k-1 belong to prompt p); `groups` reshapes them to
[num_prompts, k]. Reads in the order a step uses it:

  scores, per-token KL -> sequence rewards   r_i = score_i - kl_coef * sum_t kl_i,t
  rewards -> baseline                        rloo: mean of the other k-1 samples; mean: the group mean
  (r - baseline) [/ (group std + eps)]       the GRPO-style scale, optional
  advantage of a sequence -> every one of its response tokens

The KL penalty goes into the sequence reward (as in RLOO, Ahmadian et al. 2024), so the baseline
also removes the group's shared part of the KL term; the policy loss itself is the PPO clipped
surrogate of `aligner.rl.ppo_math` (with one update on fresh samples it is plain REINFORCE).
"""
from __future__ import annotations

from typing import Union

import torch

from aligner.rl.ppo_math import _masked, response_lengths

Number = Union[float, torch.Tensor]

BASELINES = ("rloo", "mean", "none")


def groups(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_prompts * group_size] -> [num_prompts, group_size] (a view); rows of a group are adjacent."""
    if values.dim() != 1:
        raise ValueError(f"expected one value per sample ([N]), got shape {tuple(values.shape)}")
    if group_size < 1 or values.numel() % group_size:
        raise ValueError(f"{values.numel()} samples cannot be split into groups of {group_size} "
                         "(each prompt must have exactly samples_per_prompt samples, adjacent)")
    return values.view(-1, group_size)


def sequence_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: Number) -> torch.Tensor:
    """Per-sequence rewards [B]: score - kl_coef * (KL estimate summed over the response's tokens).

    scores: [B]; kl: [B, T] per-token estimates (`ppo_math.kl_penalty`); mask: [B, T] response tokens.
    """
    lengths = response_lengths(mask)
    if scores.shape != lengths.shape:
        raise ValueError(f"scores shape {tuple(scores.shape)} != batch {tuple(lengths.shape)} of the mask")
    return scores - kl_coef * _masked(kl, mask).sum(dim=1).to(scores.dtype)


def leave_one_out_baseline(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO baseline [N]: for each sample, the mean reward of the other group_size - 1 samples of its prompt.

    It does not depend on the sample's own reward, so the policy gradient stays unbiased.
    """
    if group_size < 2:
        raise ValueError("the leave-one-out baseline needs at least 2 samples per prompt")
    grouped = groups(rewards, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return others.reshape(-1)


def group_mean_baseline(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Group mean of each sample's prompt [N] (GRPO's baseline; includes the sample itself)."""
    grouped = groups(rewards, group_size)
    return grouped.mean(dim=1, keepdim=True).expand_as(grouped).reshape(-1)


def group_std(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Unbiased (k - 1) standard deviation of each sample's prompt group [N]."""
    if group_size < 2:
        raise ValueError("a group standard deviation needs at least 2 samples per prompt")
    grouped = groups(rewards, group_size)
    return grouped.std(dim=1, unbiased=True, keepdim=True).expand_as(grouped).reshape(-1)


def group_advantages(rewards: torch.Tensor, group_size: int, baseline: str = "rloo",
                     normalize_by_std: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """Per-sequence advantages [N] = (r - baseline) [/ (group std + eps)].

    baseline: rloo (leave-one-out mean) | mean (group mean, GRPO) | none (plain REINFORCE).
    normalize_by_std: divide by the group's reward std (GRPO); a group whose samples all got the same
    reward then has advantage 0 whatever eps is, since r - baseline is 0 there.
    """
    if baseline == "rloo":
        centered = rewards - leave_one_out_baseline(rewards, group_size)
    elif baseline == "mean":
        centered = rewards - group_mean_baseline(rewards, group_size)
    elif baseline == "none":
        centered = rewards.clone()
        groups(rewards, group_size)  # the same shape check as the other baselines
    else:
        raise ValueError(f"unknown baseline {baseline!r}; choose one of {', '.join(BASELINES)}")
    if normalize_by_std:
        centered = centered / (group_std(rewards, group_size) + eps)
    return centered


def token_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A sequence's advantage on each of its response tokens: [B] -> [B, T], 0 off the mask."""
    return _masked(advantages.unsqueeze(1).expand(mask.shape), mask)
