"""Reward shaping for every RL algorithm: scores to per-token rewards, the KL penalty, GAE and the value loss.

Pure functions on tensors, nothing here touches a model or a config. Reads in the order an RL step uses it
(the masked statistics it builds on are in `aligner.rl.masked`): scores -> per-token rewards (stop
penalty, overlong penalty, normalisation, clipping, the per-token KL penalty), KL estimators and
controllers, GAE over those rewards and the critic's value loss on its returns. The advantage estimators
are in `aligner.rl.advantages`, the policy losses in `aligner.rl.policy_losses`, the entropy with the
logprobs in `aligner.models.logprobs`.

Conventions. Per-token tensors are [batch, T] over response positions; responses are right-padded,
so `mask` [batch, T] (bool or 0/1) is 1 on the first `length` columns of each row and 0 after.
Entries off the mask may hold anything (0, garbage, -inf): they never reach a result, and per-token
outputs are 0 there. Statistics and losses return 0-dim tensors; the host syncs are the
checks that raise a ValueError on an empty mask (and the controllers' float updates).
"""
from __future__ import annotations

from typing import Optional

import torch

from aligner.rl.masked import Number, bool_mask, last_positions, zero_off_mask
from aligner.rl.policy_losses import aggregate_loss

KL_ESTIMATORS = ("k1", "abs", "k2", "k3")


# ----------------------------------------------------------------------------- scores -> rewards
def apply_missing_stop_penalty(scores: torch.Tensor, ended_with_stop: torch.Tensor, penalty: float) -> torch.Tensor:
    """Replace the score of every response that never produced a stop token by the fixed `penalty`.

    scores, ended_with_stop (bool): [batch]. Truncated responses would otherwise be scored as if
    complete; Ziegler et al. give them a fixed low score (-1) instead.
    """
    if ended_with_stop.shape != scores.shape:
        raise ValueError(f"ended_with_stop shape {tuple(ended_with_stop.shape)} != scores shape {tuple(scores.shape)}")
    return torch.where(ended_with_stop.bool(), scores, torch.full_like(scores, penalty))


def normalize_scores(scores: torch.Tensor, mean: Number, std: Number) -> torch.Tensor:
    """(scores - mean) / std, e.g. with a reward model's reference-set statistics. std must be > 0."""
    std = torch.as_tensor(std, dtype=scores.dtype, device=scores.device)
    if bool((std <= 0).any()) or not bool(torch.isfinite(std).all()):
        raise ValueError(f"normalize_scores: std must be a positive finite number, got {std.tolist()}")
    return (scores - mean) / std


def clip_scores(scores: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamp scores to [-limit, limit] so one outlier score cannot dominate a batch."""
    if not limit > 0:
        raise ValueError(f"clip_scores: limit must be > 0, got {limit}")
    return scores.clamp(-limit, limit)


def overlong_penalty(response_lengths: torch.Tensor, max_length: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment [batch] (float32) to add to the scores: 0 up to max_length - buffer tokens,
    then falling linearly to -penalty at max_length (and staying there beyond).

    Truncated responses are cut mid-thought; a graded penalty near the limit teaches the policy to
    finish in time without punishing a long correct answer as hard as a truncated one.
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong_penalty: buffer must satisfy 0 < buffer <= max_length, got buffer={buffer}, "
                         f"max_length={max_length}")
    if not penalty >= 0:
        raise ValueError(f"overlong_penalty: penalty must be >= 0 (it is subtracted from the score), got {penalty}")
    excess = (response_lengths.to(torch.float64) - (max_length - buffer)).clamp(0.0, float(buffer))
    return (-penalty * excess / buffer).to(torch.float32)


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: Number) -> torch.Tensor:
    """Per-token rewards [batch, T]: -kl_coef * kl on every response token, plus the score on the last one.

    scores: [batch] sequence scores; kl: [batch, T] per-token KL estimates (`kl_penalty`). The mask may have
    holes (an episode's environment tokens): the score lands on the last masked token.
    Raises ValueError for an empty response: its score would have no token to land on.
    """
    last = last_positions(mask)  # [batch]
    if scores.shape != last.shape:
        raise ValueError(f"scores shape {tuple(scores.shape)} != batch {tuple(last.shape)} of the mask")
    if bool((last < 0).any()):
        empty = (last < 0).nonzero().flatten().tolist()
        raise ValueError(f"token_rewards: responses {empty[:8]} are empty; drop them before scoring (the "
                         "stop token counts as a response token, so this is a prompt that filled the context)")
    rewards = zero_off_mask(-kl_coef * kl, mask)  # [batch, T]
    rows = torch.arange(len(last), device=kl.device)
    # The reward model scores the whole response, so its score belongs to the last action.
    return rewards.index_put((rows, last), scores.to(rewards.dtype), accumulate=True)


# ----------------------------------------------------------------------------- KL
def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1",
               mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token estimate [batch, T] of KL(policy || reference) from the sampled tokens' logprobs.

    logprobs: under the policy that sampled the tokens; ref_logprobs: under the reference.
    estimator (Schulman's names, with log r = ref_logprobs - logprobs):
        k1: -log r (unbiased, can be negative); abs: |k1|; k2: 0.5 (log r)^2 (biased, low variance);
        k3: (r - 1) - log r (unbiased, >= 0, low variance).
    mask: optional; entries off it are 0.
    """
    log_ratio = ref_logprobs - logprobs  # log r
    if estimator == "k1":
        kl = -log_ratio
    elif estimator == "abs":
        kl = log_ratio.abs()
    elif estimator == "k2":
        kl = 0.5 * log_ratio.pow(2)
    elif estimator == "k3":
        kl = torch.expm1(log_ratio) - log_ratio  # expm1: exact near r = 1, where most tokens are
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")
    return kl if mask is None else zero_off_mask(kl, mask)


class FixedKLController:
    """A constant KL coefficient; same interface as AdaptiveKLController."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: Number, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: a fixed coefficient comes from the config, which wins on resume."""


class AdaptiveKLController:
    """The KL coefficient of Ziegler et al. (2019): nudged towards `target` KL over `horizon` samples.

    Each update multiplies the coefficient by 1 + e * n_steps / horizon, where
    e = clip(current_kl / target - 1, -0.2, 0.2) is the proportional error.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if init_kl_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs init_kl_coef >= 0, target > 0, horizon > 0; got "
                             f"{init_kl_coef}, {target}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: Number, n_steps: int) -> float:
        """Adjust for the mean KL `current_kl` measured over the last `n_steps` samples; returns the new value."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


# ----------------------------------------------------------------------------- advantages
@torch.no_grad()
def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                   lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation: (advantages, returns), both [batch, T], 0 off the mask, no gradient.

    rewards, values: [batch, T] per response token. The episode ends at each row's last response
    token, so the value after it is 0. returns = advantages + values (the critic's targets).
    The mask may have holes (an agent episode's environment and template tokens between the model's turns):
    they are not steps, so the recursion passes over them (the same as GAE over the masked tokens alone).
    """
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae_advantages: gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    if rewards.shape != values.shape:
        raise ValueError(f"rewards shape {tuple(rewards.shape)} != values shape {tuple(values.shape)}")
    dtype = torch.promote_types(values.dtype, torch.float32)  # bf16 would drift over a long response
    mask = bool_mask(mask, values)
    rewards, values = zero_off_mask(rewards.to(dtype), mask), zero_off_mask(values.to(dtype), mask)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])  # [batch]; 0 past the end: the episode is over
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # Off the mask nothing moves: padding after the end leaves the zeros the recursion starts from, and a
        # hole carries the next step's value and advantage over itself.
        next_advantage = torch.where(mask[:, t], delta + gamma * lam * next_advantage, next_advantage)
        advantages[:, t] = next_advantage
        next_value = torch.where(mask[:, t], values[:, t], next_value)
    return zero_off_mask(advantages, mask), zero_off_mask(advantages + values, mask)


# ----------------------------------------------------------------------------- losses
def clipped_value_error(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                        clip_value: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token value loss 0.5 max((v - R)^2, (v_clipped - R)^2): (loss, clipped), both [batch, T].

    v_clipped = old_values + clamp(values - old_values, -clip_value, clip_value), so one update cannot
    move a prediction far from the rollout's. clip_value None: plain 0.5 (v - R)^2.
    """
    error = (values - returns).pow(2)
    if clip_value is None:
        return 0.5 * error, torch.zeros_like(error, dtype=torch.bool)
    if not clip_value > 0:
        raise ValueError(f"clip_value must be > 0 (or None to disable value clipping), got {clip_value}")
    clipped_values = old_values + (values - old_values).clamp(-clip_value, clip_value)
    clipped_error = (clipped_values - returns).pow(2)
    return 0.5 * torch.maximum(error, clipped_error), clipped_error > error


def value_loss_sum(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                   clip_value: Optional[float],
                   aggregation: str = "token_mean") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The clipped value loss as (loss_sum, count), aggregated like the policy losses (`aggregate_loss`): sums
    over micro batches and ranks give the global loss. Third: the detached number of masked tokens where the
    clipped error won. The critic trains on this; `value_loss` is its ratio."""
    # nan padding: no nan gradient
    values, old_values, returns = (zero_off_mask(x, mask) for x in (values, old_values, returns))
    per_token, clipped = clipped_value_error(values, old_values, returns, clip_value)
    loss_sum, count = aggregate_loss(per_token, mask, aggregation)
    return loss_sum, count, (clipped & bool_mask(mask, clipped)).sum().detach()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_value: Optional[float],
               aggregation: str = "token_mean") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss over the mask, and detached statistics: clip_fraction (tokens where the clipped error won).

    values: current critic [batch, T] (with gradient); old_values: the rollout's; returns: GAE targets.
    Raises ValueError if the mask is empty.
    """
    loss_sum, count, clipped = value_loss_sum(values, old_values, returns, mask, clip_value, aggregation)
    tokens = bool_mask(mask, values).sum()
    if int(count) == 0 or int(tokens) == 0:
        raise ValueError("the loss mask is empty: no response token to train on in this batch")
    with torch.no_grad():
        stats = {"clip_fraction": clipped.to(loss_sum.dtype) / tokens.to(loss_sum.dtype)}
    return loss_sum / count.to(loss_sum.dtype), stats
