"""Policy losses: registered pure functions from logprobs and advantages to a per-token loss, and its aggregation.

`policy_loss_terms(name, ...)` gives the per-token loss [B, T] of the named loss (with the ratio it
used and the tokens the clip touched); `aggregate_loss` turns it into a (sum, count) pair whose
ratio, summed over micro batches and ranks, is the batch loss. At ratio 1 (the first minibatch
after a rollout) every loss here has the policy gradient -A * grad(logprob) per token.

Conventions (as in `aligner.rl.shaping`): per-token tensors are [B, T] over response positions,
right-padded, `mask` [B, T] bool; entries off the mask may hold anything (nan, -inf) and never
reach a value or a gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from aligner.rl.masked import zero_off_mask

AGGREGATIONS = ("token_mean", "sequence_mean_token_mean", "sequence_mean_token_sum", "constant_sum")


@dataclass
class PolicyLossTerms:
    per_token: torch.Tensor  # [B, T] loss per token, 0 off mask (before aggregation)
    ratio: torch.Tensor  # [B, T] the importance ratio the loss used (detached), 1 off mask
    clipped: torch.Tensor  # [B, T] bool: tokens whose gradient the clip switched off (or whose weight was capped)


# fn(logprobs, old_logprobs, advantages, mask, clip_low, clip_high) -> (per_token, ratio, clipped), all [B, T];
# policy_loss_terms hands it inputs already zeroed off the mask (old_logprobs and advantages detached).
PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float],
                        tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a per-token policy loss under `name`."""
    def register(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn
    return register


def policy_loss_terms(name: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, *, clip_low: float, clip_high: float,
                      weights: Optional[torch.Tensor] = None) -> PolicyLossTerms:
    """The per-token loss of the policy loss registered as `name`.

    logprobs: current policy [B, T] (with gradient); old_logprobs: the policy that produced the
    advantages' samples (as the trainer recomputed them); advantages: [B, T].
    clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high] (equal: symmetric PPO;
        clip_high > clip_low: DAPO's clip-higher).
    weights: [B, T] per-token factors on the loss, detached (e.g. truncated importance-sampling weights).
    """
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {', '.join(POLICY_LOSSES)}")
    if not (clip_low > 0 and clip_high > 0):
        raise ValueError(f"clip_low and clip_high must be > 0, got clip_low={clip_low}, clip_high={clip_high}")
    mask = mask.bool()
    # Zero the padding of every input (not only of the loss): a nan/inf there would otherwise turn
    # into a nan gradient through the masked-out branch.
    logprobs, old_logprobs, advantages = (zero_off_mask(x, mask) for x in (logprobs, old_logprobs, advantages))
    per_token, ratio, clipped = POLICY_LOSSES[name](logprobs, old_logprobs.detach(), advantages.detach(), mask,
                                                     clip_low, clip_high)
    if weights is not None:
        per_token = per_token * zero_off_mask(weights.detach(), mask)
    return PolicyLossTerms(per_token=zero_off_mask(per_token, mask),
                           ratio=torch.where(mask, ratio.detach(), 1.0),
                           clipped=clipped & mask)


def _clipped_objective(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                       clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) and where the clipped term won (no gradient there)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@register_policy_loss("ppo_clip")
def ppo_clip(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate on the per-token ratio r = exp(logprob - old_logprob)."""
    ratio = torch.exp(logprobs - old_logprobs)  # [B, T]
    per_token, clipped = _clipped_objective(ratio, advantages, clip_low, clip_high)
    return per_token, ratio, clipped


@register_policy_loss("gspo")
def gspo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
         clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025): the clipped surrogate on the length-normalised sequence ratio.

    s_i = exp(mean over i's tokens of (logprob - old_logprob)). Per token s_i,t = sg(s_i) *
    exp(logprob_t - sg(logprob_t)): its value is s_i and its gradient s_i * grad(logprob_t), so a
    sequence-mean aggregation gives s_i * grad(mean log-ratio), GSPO's gradient.
    """
    tokens = mask.sum(dim=-1, keepdim=True).clamp(min=1)  # [B, 1]
    sequence_log_ratio = (zero_off_mask(logprobs - old_logprobs, mask).sum(dim=-1, keepdim=True)
                          / tokens.to(logprobs.dtype))  # [B, 1]
    token_ratio = torch.exp(sequence_log_ratio.detach() + logprobs - logprobs.detach())  # [B, T], value s_i
    per_token, clipped = _clipped_objective(token_ratio, advantages, clip_low, clip_high)
    return per_token, token_ratio, clipped


@register_policy_loss("cispo")
def cispo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
          clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, 2025): -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logprob.

    The clip bounds the importance weight instead of dropping the token, so every token keeps a
    gradient; `clipped` marks the tokens whose weight the clip changed.
    """
    ratio = torch.exp(logprobs - old_logprobs).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -weight * advantages * logprobs, ratio, weight != ratio


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str = "token_mean",
                   constant_normalizer: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, count) whose ratio is the batch loss; sums of both over micro batches and ranks give the global one.

    token_mean: every response token weighs the same (sum over tokens / tokens).
    sequence_mean_token_mean: mean over each response's tokens, then over responses.
    sequence_mean_token_sum: sum over each response's tokens, mean over responses.
    constant_sum (Dr. GRPO): sum over all tokens / (responses * constant_normalizer), e.g. the
        generation length limit, so no response's tokens weigh more for it being short.
    The sequence modes count only non-empty responses.
    """
    masked = zero_off_mask(per_token, mask)
    mask = mask.bool()
    tokens = mask.sum(dim=-1)  # [B]
    sequences = (tokens > 0).sum()
    if aggregation == "token_mean":
        return masked.sum(), mask.sum()
    if aggregation == "sequence_mean_token_mean":
        per_sequence = masked.sum(dim=-1) / tokens.clamp(min=1).to(masked.dtype)  # [B]; 0 for empty rows
        return per_sequence.sum(), sequences
    if aggregation == "sequence_mean_token_sum":
        return masked.sum(), sequences
    if aggregation == "constant_sum":
        if constant_normalizer is None or not constant_normalizer > 0:
            raise ValueError("loss aggregation 'constant_sum' needs constant_normalizer > 0 (e.g. the maximum "
                             f"response length), got {constant_normalizer}")
        return masked.sum() / constant_normalizer, sequences
    raise ValueError(f"unknown loss aggregation {aggregation!r}; choose one of {', '.join(AGGREGATIONS)}")
