"""KTO's math (Ethayarajh et al., 2024): pure functions on per-sequence logprobs of unpaired examples.

Each example is a prompt x with one completion y and a label: desirable or undesirable. With the
log-ratio r = log pi(y|x) - log pi_ref(y|x) and the reference point z, an estimate of
KL(pi || pi_ref) that carries no gradient,

  desirable     w_D * (1 - sigmoid(beta * (r - z)))
  undesirable   w_U * (1 - sigmoid(beta * (z - r)))

so a desirable completion gains from rising above the reference point and an undesirable one from
falling below it. z is the mean log-ratio of mismatched pairs (x, y') (a completion given to another
prompt), clamped at 0. At policy = reference, r = z = 0 and every example's loss is w / 2.
Losses are returned per example; the trainer sums them and megatron divides by the example count
of the global batch.
"""
from __future__ import annotations

import torch


def kl_estimate(mismatched_log_ratios: torch.Tensor) -> torch.Tensor:
    """The reference point z: the mean of log pi(y'|x) - log pi_ref(y'|x) over mismatched pairs, clamped at
    0, with no gradient (a baseline, not something the policy is trained to move)."""
    if mismatched_log_ratios.numel() == 0:
        raise ValueError("the KL estimate needs at least one mismatched pair")
    return mismatched_log_ratios.detach().mean().clamp(min=0.0)


def kto_loss(log_ratios: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, *, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> torch.Tensor:
    """Per-example KTO loss [examples] from the log-ratios [examples], the labels (bool [examples], True:
    desirable) and the reference point `kl` (a scalar)."""
    if log_ratios.shape != desirable.shape:
        raise ValueError(f"log_ratios {tuple(log_ratios.shape)} and labels {tuple(desirable.shape)} differ in shape")
    above = beta * (log_ratios - kl)  # how far each completion's implicit reward is above the reference point
    return torch.where(desirable, desirable_weight * (1.0 - torch.sigmoid(above)),
                       undesirable_weight * (1.0 - torch.sigmoid(-above)))
