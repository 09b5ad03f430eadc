"""Masked statistics over right-padded per-token tensors, locally or over the data-parallel group.

The bottom of the RL math: `shaping`, `policy_losses`, `advantages` and `mismatch` build on these
functions, and this module imports none of them.

Conventions (as in `aligner.rl.shaping`): per-token tensors are [batch, T] over response positions;
responses are right-padded, so `mask` [batch, T] (bool or 0/1) is 1 on the first `length` columns of
each row and 0 after. Entries off the mask may hold anything (0, garbage, -inf): they never reach a
result, and per-token outputs are 0 there. Statistics return 0-dim tensors; an empty mask raises a
ValueError where a statistic needs at least one token.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

Number = Union[float, torch.Tensor]

def bool_mask(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """mask as bool, checked to have the shape of values."""
    if mask.shape != values.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match values shape {tuple(values.shape)}")
    return mask.bool()


def zero_off_mask(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values with off-mask entries set to 0 (`where`, not a product: padding may hold inf/nan)."""
    return torch.where(bool_mask(mask, values), values, torch.zeros((), dtype=values.dtype, device=values.device))


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


def last_positions(mask: torch.Tensor) -> torch.Tensor:
    """The column of each row's last masked token [batch] (long), -1 for a row with none.

    Unlike `response_lengths` it allows holes: an episode's mask is 1 on the model's tokens only, with the
    environment's and the template's tokens between turns at 0 (`aligner.agents.episode`).
    """
    mask = mask.bool()
    columns = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask, columns, torch.full_like(columns, -1)).amax(dim=-1)


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
