"""Train/inference mismatch: how far the engine's sampling logprobs are from the trainer's, and the correction.

The engine that samples (TRT-LLM, bf16 kernels, a different attention) does not give exactly the
logprobs the trainer recomputes for the same tokens, so "on-policy" samples are slightly off-policy.
`mismatch_metrics` measures it every step; `truncated_importance_weights` (TIS) reweights the loss
by the capped ratio trainer / engine, token by token or once per sequence.

Conventions (as in `aligner.rl.shaping`): [B, T] over response positions, right-padded, `mask` [B, T]
bool; entries off the mask may hold anything and never reach a result.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from aligner.rl.masked import zero_off_mask

TIS_LEVELS = ("token", "sequence")


def _log_ratio(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log(p_trainer / p_engine) [B, T] in float64, detached, 0 off the mask."""
    if trainer_logprobs.shape != engine_logprobs.shape:
        raise ValueError(f"trainer logprobs shape {tuple(trainer_logprobs.shape)} != engine logprobs shape "
                         f"{tuple(engine_logprobs.shape)}")
    return zero_off_mask(trainer_logprobs.detach().double() - engine_logprobs.detach().double(), mask)


@torch.no_grad()
def mismatch_sums(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> dict:
    """The additive parts and extremes of `mismatch_metrics` over these rows, as float64 scalars: keys
    ending in `_max` / `_min` combine by max / min, the others by a sum (how the trainer reduces the
    reports of its micro batches, so the RL update can measure the mismatch on its own forward)."""
    mask = mask.bool()
    log_ratio = _log_ratio(trainer_logprobs, engine_logprobs, mask)  # [B, T] float64
    ratio = torch.exp(log_ratio)
    return {"mismatch_tokens": mask.sum().double(),
            "mismatch_kl_sum": zero_off_mask(torch.expm1(log_ratio) - log_ratio, mask).sum(),
            "mismatch_ratio_sum": zero_off_mask(ratio, mask).sum(),
            "mismatch_ratio_max": torch.where(mask, ratio, -math.inf).max(),
            "mismatch_ratio_min": torch.where(mask, ratio, math.inf).min(),
            "mismatch_abs_logprob_diff_max": torch.where(mask, log_ratio.abs(), -math.inf).max()}


def metrics_from_sums(totals: dict) -> dict[str, float]:
    """`mismatch_metrics` from the reduced `mismatch_sums` of the whole batch."""
    tokens = float(totals["mismatch_tokens"])
    if tokens == 0:
        raise ValueError("mismatch_metrics: the mask is empty; there is no response token to compare")
    return {"mismatch_kl": float(totals["mismatch_kl_sum"]) / tokens,
            "mismatch_ratio_mean": float(totals["mismatch_ratio_sum"]) / tokens,
            "mismatch_ratio_max": float(totals["mismatch_ratio_max"]),
            "mismatch_ratio_min": float(totals["mismatch_ratio_min"]),
            "mismatch_abs_logprob_diff_max": float(totals["mismatch_abs_logprob_diff_max"])}


@torch.no_grad()
def mismatch_metrics(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                     group: Optional[dist.ProcessGroup] = None) -> dict[str, float]:
    """Mismatch statistics over the response tokens of the (global, with `group`) batch.

    mismatch_kl: mean k3 estimate of KL(engine || trainer), (r - 1) - log r with r = p_trainer / p_engine
        (the engine sampled the tokens); mismatch_ratio_mean / _max / _min: of r;
    mismatch_abs_logprob_diff_max: max |trainer - engine|.
    group: all-reduce sums and extremes over this process group (the data-parallel group).
    """
    totals = mismatch_sums(trainer_logprobs, engine_logprobs, mask)
    if group is not None:
        sums = torch.stack([totals[key] for key in ("mismatch_tokens", "mismatch_kl_sum", "mismatch_ratio_sum")])
        # Extremes through one MAX all-reduce: the minimum as the maximum of its negation.
        extremes = torch.stack([totals["mismatch_ratio_max"], -totals["mismatch_ratio_min"],
                                totals["mismatch_abs_logprob_diff_max"]])
        dist.all_reduce(sums, group=group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
        totals = {"mismatch_tokens": sums[0], "mismatch_kl_sum": sums[1], "mismatch_ratio_sum": sums[2],
                  "mismatch_ratio_max": extremes[0], "mismatch_ratio_min": -extremes[1],
                  "mismatch_abs_logprob_diff_max": extremes[2]}
    return metrics_from_sums(totals)


@torch.no_grad()
def truncated_importance_weights(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                                 level: str, cap: float) -> torch.Tensor:
    """Truncated importance-sampling weights [B, T] (detached, 0 off the mask) for the policy loss's `weights`.

    token: min(p_trainer / p_engine, cap) per token.
    sequence: min(prod over the response's tokens of p_trainer / p_engine, cap) on each of its tokens.
    The ratio is capped in log space, so a long sequence's product cannot overflow before the cap.
    """
    if level not in TIS_LEVELS:
        raise ValueError(f"unknown truncated importance sampling level {level!r}; choose one of "
                         f"{', '.join(TIS_LEVELS)}")
    if not cap > 0:
        raise ValueError(f"the truncated importance sampling cap must be > 0, got {cap}")
    mask = mask.bool()
    log_ratio = _log_ratio(trainer_logprobs, engine_logprobs, mask)  # [B, T] float64
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    weights = torch.exp(log_ratio.clamp(max=math.log(cap)))
    dtype = torch.promote_types(trainer_logprobs.dtype, torch.float32)
    return zero_off_mask(weights, mask).to(dtype)


@torch.no_grad()
def weight_metrics(weights: torch.Tensor, mask: torch.Tensor, cap: float,
                   group: Optional[dist.ProcessGroup] = None) -> dict[str, float]:
    """importance_weight_mean over the response tokens of the (global, with `group`) batch, and
    importance_weight_clipped_fraction: the share of them whose ratio reached the cap."""
    mask = mask.bool()
    clipped = weights.double() >= cap * (1 - 1e-6)
    sums = torch.stack([mask.sum().double(), zero_off_mask(weights.double(), mask).sum(),
                        (clipped & mask).sum().double()])
    if group is not None:
        dist.all_reduce(sums, group=group)
    tokens = max(float(sums[0]), 1.0)
    return {"importance_weight_mean": float(sums[1]) / tokens,
            "importance_weight_clipped_fraction": float(sums[2]) / tokens}
