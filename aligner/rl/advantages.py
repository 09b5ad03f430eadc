"""Advantage estimators: registered pure functions from a step's scores (and values) to per-token advantages.

An RL step names its estimator in config; `compute_advantages(name, inputs, settings)` runs it.
PPO is `gae` with a critic; the group methods (RLOO, GRPO, Dr. GRPO, REINFORCE) need no critic and
compare the k samples of a prompt; REINFORCE++ normalises over the whole batch instead.

Conventions (as in `aligner.rl.shaping`): per-token tensors are [B, T] over response positions,
right-padded, `mask` [B, T] bool; entries off the mask may hold anything and never reach a result.
A step samples k responses per prompt, adjacent: rows p*k .. p*k+k-1 belong to prompt p.

Every estimator credits the sequence reward r_i = score_i - kl_coef * sum_t kl_i,t. The group
estimators put the KL penalty into that sequence reward (as RLOO, Ahmadian et al. 2024), so the
baseline also removes the group's shared part of it; `gae` and `reinforce_plus_plus` hand it out
per token (`shaping.token_rewards`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from aligner.rl.masked import Number, masked_whiten, zero_off_mask
from aligner.rl.shaping import gae_advantages, token_rewards


@dataclass
class AdvantageInputs:
    """What a step knows when it estimates advantages."""

    scores: torch.Tensor  # [B] sequence scores, already shaped (penalties, normalisation)
    kl: torch.Tensor  # [B, T] per-token KL estimate (shaping.kl_penalty), 0 off mask
    kl_coef: float
    mask: torch.Tensor  # [B, T] bool
    group_size: int = 1  # samples per prompt (k), adjacent rows
    values: Optional[torch.Tensor] = None  # [B, T] critic values (gae only)
    group: Optional[dist.ProcessGroup] = None  # data-parallel group for batch-level statistics


@dataclass
class AdvantageSettings:
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True  # gae: masked whitening over the global batch
    whiten_rewards: bool = False  # gae: per-token rewards scaled to unit variance (mean kept)
    group_std: bool = True  # grpo: divide by the group's reward std
    std_eps: float = 1e-6


@dataclass
class Advantages:
    advantages: torch.Tensor  # [B, T], 0 off mask
    returns: Optional[torch.Tensor]  # [B, T] critic targets (gae), else None
    sequence_rewards: torch.Tensor  # [B] score - kl_coef * summed KL (what the estimator credited)


EstimatorFn = Callable[[AdvantageInputs, AdvantageSettings], Advantages]


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    fn: EstimatorFn
    needs_values: bool = False  # needs a critic's values in AdvantageInputs.values
    min_group_size: int = 1  # fewest samples per prompt it works with


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str, needs_values: bool = False,
                                 min_group_size: int = 1) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator: register `fn(inputs, settings) -> Advantages` under `name`."""
    def register(fn: EstimatorFn) -> EstimatorFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(name, fn, needs_values, min_group_size)
        return fn
    return register


def compute_advantages(name: str, inputs: AdvantageInputs, settings: AdvantageSettings) -> Advantages:
    """Run the estimator registered as `name` after checking that the inputs suit it."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {', '.join(ADVANTAGE_ESTIMATORS)}")
    estimator = ADVANTAGE_ESTIMATORS[name]
    if estimator.needs_values and inputs.values is None:
        raise ValueError(f"advantage estimator {name!r} needs the critic's values (AdvantageInputs.values)")
    if inputs.group_size < estimator.min_group_size:
        raise ValueError(f"advantage estimator {name!r} needs at least {estimator.min_group_size} samples per "
                         f"prompt, got {inputs.group_size}")
    groups(inputs.scores, inputs.group_size)  # each prompt's samples complete and adjacent
    return estimator.fn(inputs, settings)


# ----------------------------------------------------------------------------- group helpers
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

    scores: [B]; kl: [B, T] per-token estimates (`shaping.kl_penalty`); mask: [B, T] response tokens.
    """
    if scores.shape != mask.shape[:1]:
        raise ValueError(f"scores shape {tuple(scores.shape)} != batch {tuple(mask.shape[:1])} of the mask")
    return scores - kl_coef * zero_off_mask(kl, mask).sum(dim=1).to(scores.dtype)


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


def informative_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_prompts] bool: False for a prompt whose k samples all got the same score.

    Such a group has advantage 0 under any group baseline, so it adds nothing but cost to the
    update; DAPO's dynamic sampling drops it and draws more prompts.
    """
    grouped = groups(scores, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)


def token_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A sequence's advantage on each of its response tokens: [B] -> [B, T], 0 off the mask."""
    return zero_off_mask(advantages.unsqueeze(1).expand(mask.shape), mask)


def with_fixed_rows(advantages: torch.Tensor, mask: torch.Tensor, fixed: dict[int, float]) -> torch.Tensor:
    """`advantages` [B, T] with rows `fixed` ({row: value}) set to that value on their masked tokens (0 elsewhere):
    rollouts whose credit a rule decides instead of the estimator (an episode ended by a bad tool call)."""
    if not fixed:
        return advantages
    out = advantages.clone()
    for row, value in fixed.items():
        out[row] = value * mask[row].to(out.dtype)
    return out


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go sum_{s >= t} gamma^(s - t) r_s [B, T] within each response, 0 off the mask, no gradient.

    GAE with no critic (V = 0) and lam = 1 is exactly this sum.
    """
    rewards = zero_off_mask(rewards, mask)
    returns, _ = gae_advantages(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
    return returns


def _sequence_estimate(inputs: AdvantageInputs, centre: Callable[[torch.Tensor], torch.Tensor]) -> Advantages:
    """A sequence-level estimator: centre(sequence rewards [B]) -> [B], broadcast to the response tokens."""
    rewards = sequence_rewards(inputs.scores, inputs.kl, inputs.mask, inputs.kl_coef)
    return Advantages(advantages=token_advantages(centre(rewards), inputs.mask), returns=None,
                      sequence_rewards=rewards)


# ----------------------------------------------------------------------------- estimators
@register_advantage_estimator("gae", needs_values=True)
def gae(inputs: AdvantageInputs, settings: AdvantageSettings) -> Advantages:
    """PPO: per-token rewards -> [reward scaling] -> GAE against the critic's values -> [whitening].

    returns (the critic's targets) are taken before the advantages are whitened.
    """
    mask, group = inputs.mask, inputs.group
    rewards = token_rewards(inputs.scores, inputs.kl, mask, inputs.kl_coef)
    credited = sequence_rewards(inputs.scores, inputs.kl, mask, inputs.kl_coef)
    if settings.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False, group=group)
    advantages, returns = gae_advantages(rewards, inputs.values, mask, settings.gamma, settings.lam)
    if settings.whiten_advantages:
        advantages = masked_whiten(advantages, mask, group=group)
    return Advantages(advantages=advantages, returns=returns, sequence_rewards=credited)


@register_advantage_estimator("rloo", min_group_size=2)
def rloo(inputs: AdvantageInputs, settings: AdvantageSettings) -> Advantages:
    """RLOO (Ahmadian et al. 2024): r_i minus the mean reward of the prompt's other k - 1 samples."""
    return _sequence_estimate(inputs, lambda r: r - leave_one_out_baseline(r, inputs.group_size))


# The group-mean estimators need 2 samples per prompt: the mean of one sample is the sample itself.
@register_advantage_estimator("grpo", min_group_size=2)
def grpo(inputs: AdvantageInputs, settings: AdvantageSettings) -> Advantages:
    """GRPO (Shao et al. 2024): r_i minus the group mean; with settings.group_std the score part is divided by
    the group's score std (+ eps), the KL penalty part is not.

    Dividing the KL part too would turn a group whose scores tie (std 0) into advantages of about +-1 made of
    the KL penalty alone, whatever its coefficient: a pull towards the reference as strong as the reward's.
    DeepSeekMath keeps the KL out of the normalised reward too (a separate loss term). A group
    whose samples all scored the same thus gets only its centred KL penalty (0 without one).
    """
    k = inputs.group_size
    if not settings.group_std:
        return _sequence_estimate(inputs, lambda r: r - group_mean_baseline(r, k))
    rewards = sequence_rewards(inputs.scores, inputs.kl, inputs.mask, inputs.kl_coef)
    scores = inputs.scores.to(rewards.dtype)
    penalties = scores - rewards  # kl_coef * the summed KL estimate
    centred = (scores - group_mean_baseline(scores, k)) / (group_std(scores, k) + settings.std_eps)
    centred = centred - (penalties - group_mean_baseline(penalties, k))
    return Advantages(advantages=token_advantages(centred, inputs.mask), returns=None, sequence_rewards=rewards)


@register_advantage_estimator("dr_grpo", min_group_size=2)
def dr_grpo(inputs: AdvantageInputs, settings: AdvantageSettings) -> Advantages:
    """Dr. GRPO (Liu et al. 2025): r_i minus the group mean, no std division (pair it with `constant_sum`)."""
    return _sequence_estimate(inputs, lambda r: r - group_mean_baseline(r, inputs.group_size))


@register_advantage_estimator("reinforce")
def reinforce(inputs: AdvantageInputs, settings: AdvantageSettings) -> Advantages:
    """Plain REINFORCE: the sequence reward itself, no baseline."""
    return _sequence_estimate(inputs, lambda r: r)


@register_advantage_estimator("on_policy_distillation")
def on_policy_distillation(inputs: AdvantageInputs, settings: AdvantageSettings) -> Advantages:
    """On-policy distillation: each token's own reward, no discount and no baseline. The reference policy is
    the teacher, so -kl_coef * kl_t is minus the per-token reverse KL to it (with the k1 estimator,
    log pi_teacher(y_t) - log pi(y_t)); a sequence score, if any, is added to every token."""
    mask = inputs.mask
    per_token = inputs.scores.unsqueeze(1).to(inputs.kl.dtype) - inputs.kl_coef * inputs.kl
    return Advantages(zero_off_mask(per_token, mask), None,
                      sequence_rewards(inputs.scores, inputs.kl, mask, inputs.kl_coef))


@register_advantage_estimator("reinforce_plus_plus")
def reinforce_plus_plus(inputs: AdvantageInputs, settings: AdvantageSettings) -> Advantages:
    """REINFORCE++ (Hu 2025): per-token rewards, return-to-go with gamma, whitened over the global batch.

    Batch-level normalisation takes the place of both the critic and a group baseline.
    """
    mask = inputs.mask
    rewards = token_rewards(inputs.scores, inputs.kl, mask, inputs.kl_coef)
    returns = discounted_returns(rewards, mask, settings.gamma)
    advantages = masked_whiten(returns, mask, group=inputs.group)
    return Advantages(advantages=advantages, returns=None,
                      sequence_rewards=sequence_rewards(inputs.scores, inputs.kl, mask, inputs.kl_coef))
