"""The PPO math: pure functions on tensors, nothing here touches a model or a config.

Reads in the order a PPO step uses it: masked statistics (local or over the data-parallel group),
scores -> per-token rewards (stop penalty, overlong penalty, normalisation, clipping, the per-token
KL penalty), KL estimators and controllers, GAE and the critic's value loss. The advantage estimators
are in `aligner.rl.advantages`, the policy losses in `aligner.rl.policy_losses`, the entropy with the
logprobs in `aligner.generation.logprobs`.

Conventions. Per-token tensors are [batch, T] over response positions; responses are right-padded,
so `mask` [batch, T] (bool or 0/1) is 1 on the first `length` columns of each row and 0 after.
Entries off the mask may hold anything (0, garbage, -inf): they never reach a result, and per-token
outputs are 0 there. Statistics and losses return 0-dim tensors; the host syncs are the
checks that raise a ValueError on an empty mask (and the controllers' float updates).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

Number = Union[float, torch.Tensor]

KL_ESTIMATORS = ("k1", "abs", "k2", "k3")


# ----------------------------------------------------------------------------- masked statistics
def _bool_mask(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    if mask.shape != values.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match values shape {tuple(values.shape)}")
    return mask.bool()


def zero_off_mask(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values with off-mask entries set to 0 (`where`, not a product: padding may hold inf/nan)."""
    return torch.where(_bool_mask(mask, values), values, torch.zeros((), dtype=values.dtype, device=values.device))


def response_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Tokens per response [batch] (long); raises unless every row of mask [batch, T] is right-padded."""
    mask = mask.bool()
    lengths = mask.sum(dim=-1)
    columns = torch.arange(mask.shape[-1], device=mask.device)
    if not torch.equal(mask, columns < lengths.unsqueeze(-1)):
        bad = (mask != (columns < lengths.unsqueeze(-1))).any(dim=-1).nonzero().flatten().tolist()
        raise ValueError(f"response mask rows {bad[:8]} are not right-padded (1s then 0s): build the mask "
                         "from response lengths, with each response starting at column 0")
    return lengths


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of values on the mask: a scalar, or per slice along `dim`."""
    masked = zero_off_mask(values, mask)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None,
                group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Mean of values on the mask: a scalar, or per slice along `dim`.

    group: all-reduce the sum and count over this process group (the data-parallel group for a
    global-batch mean); the result then carries no gradient. Only for dim=None.
    Raises ValueError when the mask (or, with dim, one of its slices) is empty.
    """
    total = masked_sum(values, mask, dim)
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    if group is not None:
        if dim is not None:
            raise ValueError("masked_mean: `group` reduces over ranks and is only supported with dim=None")
        sums = torch.stack([total.detach().double(), count.double()])  # [2]
        dist.all_reduce(sums, group=group)
        total, count = sums[0].to(values.dtype), sums[1]
    if bool((count == 0).any()):
        raise ValueError("masked_mean: the mask is empty" + ("" if dim is None else f" for some slice along dim {dim}")
                         + "; there is nothing to average")
    return total / count.to(total.dtype)


def masked_moment_sums(values: torch.Tensor, mask: torch.Tensor, center: Number = 0.0) -> torch.Tensor:
    """[count, sum(x - center), sum((x - center)^2)] over the mask, float64 and detached.

    Sums (not means) so that shards of a batch combine by addition, for a center shared by the
    shards: the data-parallel path all-reduces exactly this tensor. Centering on (near) the mean
    keeps the variance exact; from raw sums, sum_sq - n mean^2 cancels away the digits when the
    mean is large next to the spread, even in float64.
    """
    masked = zero_off_mask(values.detach().double() - torch.as_tensor(center, dtype=torch.float64), mask)
    return torch.stack([mask.bool().sum().double(), masked.sum(), masked.pow(2).sum()])


def moments_from_sums(sums: torch.Tensor, unbiased: bool = False,
                      center: Number = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, variance) in float64 from `masked_moment_sums(..., center)` output (possibly summed over shards)."""
    count, total, total_sq = sums.unbind()
    needed = 2 if unbiased else 1
    if float(count) < needed:
        raise ValueError(f"masked statistics need at least {needed} masked entr{'ies' if needed > 1 else 'y'}"
                         f"{' for the unbiased variance' if unbiased else ''}, got {int(count)}")
    offset = total / count  # mean - center
    # Rounding can leave a tiny negative number for (near-)constant values.
    var = torch.clamp(total_sq - count * offset * offset, min=0.0) / (count - 1 if unbiased else count)
    return center + offset, var


def masked_moments(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = False,
                   group: Optional[dist.ProcessGroup] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, variance) of values on the mask, float64 0-dim tensors, no gradient.

    Two passes: the mean, then the spread around it. group: all-reduce the sums of each pass over
    this process group (two 3-element all-reduces), so the moments are the global batch's across
    data-parallel ranks.
    """
    center = torch.zeros((), dtype=torch.float64, device=values.device)
    for _ in range(2):
        sums = masked_moment_sums(values, mask, center)
        if group is not None:
            dist.all_reduce(sums, group=group)
        center, var = moments_from_sums(sums, unbiased, center)
    return center, var


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = False,
               group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Variance of values on the mask (population by default; unbiased divides by count - 1), no gradient."""
    return masked_moments(values, mask, unbiased, group)[1].to(values.dtype)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, unbiased: bool = False,
                  eps: float = 1e-8, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) with statistics over the mask; 0 off the mask, no gradient.

    shift_mean: False adds the mean back, so only the scale changes (OpenAI's choice for rewards,
        True is theirs for advantages).
    unbiased: the default population variance matches OpenAI's tf.moments; True is torch.var's default.
    group: the data-parallel group, to whiten with the statistics of the global batch.
    """
    mean, var = masked_moments(values, mask, unbiased, group)
    mean, var = mean.to(values.dtype), var.to(values.dtype)
    whitened = (values.detach() - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return zero_off_mask(whitened, mask)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) on the mask: 1 is a perfect critic, <= 0 is no better than a constant.

    nan when the returns are constant on the mask (the ratio is undefined).
    """
    _, returns_var = masked_moments(returns, mask, group=group)
    _, error_var = masked_moments(returns.detach() - values.detach(), mask, group=group)
    if float(returns_var) == 0.0:
        return torch.tensor(float("nan"), dtype=values.dtype, device=values.device)
    return (1.0 - error_var / returns_var).to(values.dtype)


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

    scores: [batch] sequence scores; kl: [batch, T] per-token KL estimates (`kl_penalty`).
    Raises ValueError for an empty response: its score would have no token to land on.
    """
    lengths = response_lengths(mask)  # [batch]
    if scores.shape != lengths.shape:
        raise ValueError(f"scores shape {tuple(scores.shape)} != batch {tuple(lengths.shape)} of the mask")
    if bool((lengths == 0).any()):
        empty = (lengths == 0).nonzero().flatten().tolist()
        raise ValueError(f"token_rewards: responses {empty[:8]} are empty; drop them before scoring (the "
                         "stop token counts as a response token, so this is a prompt that filled the context)")
    rewards = zero_off_mask(-kl_coef * kl, mask)  # [batch, T]
    rows = torch.arange(len(lengths), device=kl.device)
    # The reward model scores the whole response, so its score belongs to the last action.
    return rewards.index_put((rows, lengths - 1), scores.to(rewards.dtype), accumulate=True)


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
    """
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae_advantages: gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    if rewards.shape != values.shape:
        raise ValueError(f"rewards shape {tuple(rewards.shape)} != values shape {tuple(values.shape)}")
    response_lengths(mask)  # the masking below assumes right padding
    dtype = torch.promote_types(values.dtype, torch.float32)  # bf16 would drift over a long response
    mask = _bool_mask(mask, values)
    rewards, values = zero_off_mask(rewards.to(dtype), mask), zero_off_mask(values.to(dtype), mask)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])  # [batch]; 0 past the end: the episode is over
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # Off the mask the advantage stays 0, so padding never leaks into the last real token.
        next_advantage = torch.where(mask[:, t], delta + gamma * lam * next_advantage, 0.0)
        advantages[:, t] = next_advantage
        next_value = values[:, t]
    return advantages, zero_off_mask(advantages + values, mask)


# ----------------------------------------------------------------------------- losses
def _mean_loss(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    # Imported here: policy_losses builds on this module's masked helpers.
    from aligner.rl.policy_losses import aggregate_loss

    loss_sum, count = aggregate_loss(per_token, mask, aggregation)
    if int(count) == 0:
        raise ValueError("the loss mask is empty: no response token to train on in this batch")
    return loss_sum / count.to(loss_sum.dtype)


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


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_value: Optional[float],
               aggregation: str = "token_mean") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss over the mask, and detached statistics: clip_fraction (tokens where the clipped error won).

    values: current critic [batch, T] (with gradient); old_values: the rollout's; returns: GAE targets.
    Raises ValueError if the mask is empty.
    """
    # nan padding: no nan gradient
    values, old_values, returns = (zero_off_mask(x, mask) for x in (values, old_values, returns))
    per_token, clipped = clipped_value_error(values, old_values, returns, clip_value)
    loss = _mean_loss(per_token, mask, aggregation)
    with torch.no_grad():
        stats = {"clip_fraction": masked_mean(clipped.to(per_token.dtype), mask)}
    return loss, stats
