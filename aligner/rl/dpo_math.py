"""The DPO family's math: pure functions on per-sequence logprobs, nothing here touches a model.

Reads in the order a DPO step uses it: per-token logprobs -> per-sequence logprobs (summed or
averaged over response tokens), implicit rewards, then the preference losses and the optional SFT
term that `preference_loss` combines.

Conventions. Per-sequence tensors are [pairs]. The implicit reward of a response is
beta * (log pi(y|x) - log pi_ref(y|x)); its margin is chosen minus rejected. Losses are returned
per pair ([pairs]); the trainer sums them and megatron divides by the pair count of the global batch.

  dpo        -(1-eps) log sigmoid(m) - eps log sigmoid(-m)       m = reward margin; eps = label
             smoothing (conservative DPO: the label is wrong with probability eps); eps=0 is DPO
  ipo        (m / beta - 1 / (2 beta))^2                         IPO: the log-ratio margin is
             regressed to 1/(2 beta) instead of being pushed to infinity
  rpo_sq     1/2 (m - g)^2                                       g = eta (r_chosen - r_rejected):
  rpo_fwd_kl KL(Bern(sigmoid(g)) || Bern(sigmoid(m)))            reward-aware preference optimisation
  rpo_bwd_kl KL(Bern(sigmoid(m)) || Bern(sigmoid(g)))            (Nemotron-4 340B): the implicit
             preference is matched to the one the given rewards imply, not to certainty
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PREFERENCE_LOSSES = ("dpo", "ipo", "rpo_sq", "rpo_fwd_kl", "rpo_bwd_kl")
RPO_LOSSES = ("rpo_sq", "rpo_fwd_kl", "rpo_bwd_kl")


def sequence_logprobs(token_logprobs: torch.Tensor, lengths: torch.Tensor, average: bool) -> torch.Tensor:
    """Per-sequence logprob [batch] from per-token logprobs [batch, T] of right-padded responses.

    lengths [batch]: response tokens per row (entries at or after a row's length are ignored, even
    if inf/nan). average: mean over the response tokens instead of the sum.
    """
    if token_logprobs.dim() != 2 or lengths.shape != token_logprobs.shape[:1]:
        raise ValueError(f"expected token_logprobs [batch, T] and lengths [batch], got "
                         f"{tuple(token_logprobs.shape)} and {tuple(lengths.shape)}")
    if bool((lengths < 1).any()):
        raise ValueError(f"every response needs at least one token; lengths {lengths.tolist()}")
    inside = torch.arange(token_logprobs.shape[1], device=token_logprobs.device) < lengths.unsqueeze(1)
    total = torch.where(inside, token_logprobs, torch.zeros((), dtype=token_logprobs.dtype,
                                                               device=token_logprobs.device)).sum(dim=1)
    return total / lengths.to(total.dtype) if average else total


def implicit_rewards(policy_logprobs: torch.Tensor, reference_logprobs: torch.Tensor, beta: float) -> torch.Tensor:
    """beta * (log pi - log pi_ref) per sequence: the reward DPO's optimal policy implies."""
    return beta * (policy_logprobs - reference_logprobs)


def dpo_loss(margin: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-pair DPO loss from the implicit reward margin [pairs]; label_smoothing: conservative DPO."""
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    return -(1.0 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)


def ipo_loss(margin: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-pair IPO loss: the log-ratio margin (margin / beta) regressed to 1 / (2 beta)."""
    return (margin / beta - 1.0 / (2.0 * beta)) ** 2


def _bernoulli_kl(p_logit: torch.Tensor, q_logit: torch.Tensor) -> torch.Tensor:
    """KL(Bern(sigmoid(p_logit)) || Bern(sigmoid(q_logit))), computed from log-sigmoids (stable
    where a probability underflows)."""
    p = torch.sigmoid(p_logit)
    return (p * (F.logsigmoid(p_logit) - F.logsigmoid(q_logit))
            + (1.0 - p) * (F.logsigmoid(-p_logit) - F.logsigmoid(-q_logit)))


def rpo_loss(margin: torch.Tensor, target_margin: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-pair RPO loss: a distance between the implicit preference (logit `margin`) and the one
    the given rewards imply (logit `target_margin` = eta * (r_chosen - r_rejected))."""
    if kind == "rpo_sq":
        return 0.5 * (margin - target_margin) ** 2
    if kind == "rpo_fwd_kl":
        return _bernoulli_kl(target_margin, margin)
    if kind == "rpo_bwd_kl":
        return _bernoulli_kl(margin, target_margin)
    raise ValueError(f"unknown RPO loss {kind!r}; expected one of {RPO_LOSSES}")


def preference_loss(margin: torch.Tensor, *, kind: str, beta: float, label_smoothing: float = 0.0,
                    target_margin: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair preference loss of `kind` (see the module docstring) from the reward margin [pairs]."""
    if kind == "dpo":
        return dpo_loss(margin, label_smoothing)
    if kind == "ipo":
        return ipo_loss(margin, beta)
    if kind in RPO_LOSSES:
        if target_margin is None:
            raise ValueError(f"{kind} needs given rewards for the chosen and rejected responses")
        return rpo_loss(margin, target_margin, kind)
    raise ValueError(f"unknown preference loss {kind!r}; expected one of {PREFERENCE_LOSSES}")


def sft_loss(chosen_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-pair negative log-likelihood of the chosen response (a per-sequence logprob, summed or
    averaged over its tokens): keeps the chosen responses likely while margins grow."""
    return -chosen_logprobs
