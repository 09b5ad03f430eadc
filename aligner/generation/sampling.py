"""Token selection for generation: filtering, logprobs, reproducible draws, vocab-parallel helpers.

Pure functions on tensors. Logits here are a tensor-parallel shard `[batch, vocab_shard]` whose
first entry is global token id `vocab_start`; with `group=None` (or a group of one) the shard is
the whole vocabulary and no collective runs.

Sampling is by inverse CDF: one uniform u per row and step, and the token is the first whose
cumulative probability exceeds u. The uniforms come from a counter-based generator, an integer
hash of (seed, sample index, step), so a sample's draws depend only on its own index, never on
the rest of the batch, its padding or the parallel layout. Across vocabulary shards the CDF is
split: each rank sums its shard's probability mass, the [batch] masses are gathered, and the
rank whose interval holds u picks the token (three small collectives; logits never travel).
Top-k (and top-p after top-k) sample among per-shard top-k candidates gathered across ranks; only
top-p without top-k gathers the whole vocabulary, since the nucleus may be any size.
Greedy is a global argmax from (value, id) pairs of each shard.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

_MASK32 = 0xFFFFFFFF
# Odd 32-bit constants: the multipliers of the "lowbias32" integer hash (C. Wellons, hash
# prospector) and two arbitrary salts that separate the seed and step streams.
_MUL_A, _MUL_B = 0x7FEB352D, 0x846CA68B
_SALT_SEED, _SALT_STEP = 0x9E3779B9, 0x632BE5AB


# ----------------------------------------------------------------------------- filtering, logprobs
def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in float32; temperature 0 (greedy) or 1 leaves the logits as they are."""
    logits = logits.float()
    return logits / temperature if temperature > 0 and temperature != 1.0 else logits


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability reaches p.

    A token is dropped (-inf) when the tokens ranked above it already hold probability >= p, so
    the most likely token always stays. p >= 1: no-op.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    drop_sorted = torch.cumsum(probs, dim=-1) - probs >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[token] per row, in float32. logits [..., vocab]; tokens [...]."""
    logits = logits.float()
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


# ----------------------------------------------------------------------------- reproducible uniforms
def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values in [0, 2**32).

    Products overflow int64 for large inputs, but wrap-around keeps the low 32 bits exact, and
    those are all that is kept.
    """
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


def sample_keys(seed: int, sample_ids: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per sample from (seed, sample index): the sample's stream. [batch] int64."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"sampling seed must be in [0, 2**32), got {seed}")
    seed_key = _mix32(torch.tensor(seed ^ _SALT_SEED, dtype=torch.int64))
    return _mix32(seed_key.to(sample_ids.device) ^ (sample_ids.to(torch.int64) & _MASK32))


def uniforms(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) for each sample key [batch] and step [steps]: [batch, steps] float32.

    u = (h + 0.5) / 2**24 from the top 24 bits of the hash: exactly representable, never 0 or 1.
    """
    step_salt = _mix32((steps.to(keys.device, torch.int64) + _SALT_STEP) & _MASK32)
    bits = _mix32(keys.unsqueeze(-1) ^ step_salt) >> 8
    return (bits.to(torch.float32) + 0.5) * (1.0 / 2**24)


# ----------------------------------------------------------------------------- vocab-parallel helpers
def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    """[world, *tensor.shape]: every rank's tensor, stacked in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


def vocab_parallel_argmax(values: torch.Tensor, vocab_start: int = 0, group=None) -> torch.Tensor:
    """Global token id of each row's maximum over the sharded vocabulary [batch] (ties: lowest id).

    values: [batch, vocab_shard]. Sends one (value, id) pair per row and rank.
    """
    best_value, best_index = values.max(dim=-1)
    best_id = best_index + vocab_start
    if _world(group) == 1:
        return best_id
    # float64 holds every token id exactly; rank order = id order, so argmax's first-hit rule
    # keeps the lowest id among equal maxima, as a single-shard argmax does.
    pairs = _all_gather(torch.stack([best_value.double(), best_id.double()], dim=-1), group)  # [world, batch, 2]
    winner = pairs[..., 0].argmax(dim=0)  # [batch]
    return pairs[..., 1].gather(0, winner.unsqueeze(0)).squeeze(0).long()


def vocab_parallel_logsumexp(logits: torch.Tensor, group=None) -> torch.Tensor:
    """logsumexp over the sharded vocabulary, [batch] float32 (two [batch] all-reduces)."""
    logits = logits.float()
    if _world(group) == 1:
        return torch.logsumexp(logits, dim=-1)
    row_max = logits.max(dim=-1).values
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    sum_exp = torch.exp(logits - row_max.unsqueeze(-1)).sum(dim=-1)
    dist.all_reduce(sum_exp, group=group)
    return row_max + torch.log(sum_exp)


def vocab_parallel_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_start: int = 0,
                                  group=None) -> torch.Tensor:
    """log_softmax over the sharded vocabulary at global token ids `tokens` [batch], float32."""
    logits = logits.float()
    if _world(group) == 1:
        return token_logprobs(logits, tokens - vocab_start if vocab_start else tokens)
    local = tokens - vocab_start
    owned = (local >= 0) & (local < logits.shape[-1])
    chosen = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    chosen = torch.where(owned, chosen, torch.zeros_like(chosen))
    dist.all_reduce(chosen, group=group)
    return chosen - vocab_parallel_logsumexp(logits, group)


def vocab_parallel_top_k(logits: torch.Tensor, k: int, vocab_start: int = 0, group=None):
    """The k largest logits of each row over the sharded vocabulary: (values, global ids) [batch, k].

    Sorted descending; each rank contributes its own top-k, so k * world candidates travel.
    """
    local_k = min(k, logits.shape[-1])
    values, index = torch.topk(logits, local_k, dim=-1)
    ids = index + vocab_start
    if _world(group) > 1:
        values = _all_gather(values, group).permute(1, 0, 2).reshape(logits.shape[0], -1)
        ids = _all_gather(ids, group).permute(1, 0, 2).reshape(logits.shape[0], -1)
    top_values, order = torch.topk(values, min(k, values.shape[-1]), dim=-1)
    return top_values, ids.gather(-1, order)


def gather_vocab(logits: torch.Tensor, group=None) -> torch.Tensor:
    """The full vocabulary [batch, vocab] from shards [batch, vocab_shard] (every rank gets it)."""
    if _world(group) == 1:
        return logits
    return torch.cat(list(_all_gather(logits, group)), dim=-1)


def _search_cdf(cdf: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Index of the first entry whose cumulative weight exceeds the target, per row [batch].

    cdf [batch, n]: cumulative sums of weights >= 0; targets [batch] in [0, row total). Rounding
    can push a target to the total: it is held just below, so a zero-weight entry is never picked.
    """
    targets = torch.minimum(targets.unsqueeze(-1), cdf[:, -1:] * (1.0 - 2.0**-23))
    return torch.searchsorted(cdf, targets, right=True).squeeze(-1)


def vocab_parallel_sample(logits: torch.Tensor, uniform: torch.Tensor, vocab_start: int = 0,
                          group=None) -> torch.Tensor:
    """Draw global token ids [batch] from softmax(logits) over the sharded vocabulary by inverse CDF.

    uniform: [batch] in (0, 1). Across shards: global max (all-reduce), per-shard masses
    (all-gather of [batch]), the owning rank's local search, its id shared (all-reduce).
    """
    row_max = logits.amax(dim=-1, keepdim=True)
    if _world(group) == 1:
        cdf = torch.cumsum(torch.exp(logits - row_max), dim=-1)
        return _search_cdf(cdf, uniform * cdf[:, -1]) + vocab_start
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    cdf = torch.cumsum(torch.exp(logits - row_max), dim=-1)
    masses = _all_gather(cdf[:, -1], group)  # [world, batch]
    ends = torch.cumsum(masses, dim=0)
    targets = uniform * ends[-1]
    beyond = ends > targets
    # The first shard whose interval ends beyond the target; if rounding put the target at the
    # very end, the last shard with any mass.
    last_with_mass = (masses > 0).long().cumsum(dim=0).argmax(dim=0)
    owner = torch.where(beyond.any(dim=0), beyond.long().argmax(dim=0), last_with_mass)
    rank = dist.get_rank(group)
    local_id = _search_cdf(cdf, (targets - (ends[rank] - masses[rank])).clamp(min=0)) + vocab_start
    chosen = torch.where(owner == rank, local_id + 1, torch.zeros_like(local_id))
    dist.all_reduce(chosen, group=group)
    return chosen - 1


def sample_with_logprobs(logits: torch.Tensor, uniform: torch.Tensor) -> tuple:
    """`vocab_parallel_sample` on one whole-vocabulary shard, plus the drawn tokens' log-softmax.

    (tokens [batch], logprobs [batch] float32). The same draw, bit for bit; the logprob reuses
    the draw's exponentials: log_softmax(x)_t = (x_t - max) - log(sum exp(x - max)), that sum
    being the CDF's last entry, so no second pass over the vocabulary (logsumexp) is needed.
    """
    shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True)
    cdf = torch.cumsum(torch.exp(shifted), dim=-1)
    total = cdf[:, -1]
    tokens = _search_cdf(cdf, uniform * total)
    return tokens, shifted.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.log(total)


def select_tokens(
    scaled_logits: torch.Tensor,
    *,
    greedy: bool,
    top_k: int = 0,
    top_p: float = 1.0,
    uniform: Optional[torch.Tensor] = None,
    vocab_start: int = 0,
    group=None,
) -> torch.Tensor:
    """Next token ids [batch] from temperature-scaled logits of this shard [batch, vocab_shard].

    greedy: global argmax. Otherwise a draw with `uniform` [batch] (see `uniforms`) from the
    softmax after top-k and top-p filtering. Every rank of `group` returns the same tokens.
    """
    if greedy:
        return vocab_parallel_argmax(scaled_logits, vocab_start, group)
    if top_k > 0:
        values, ids = vocab_parallel_top_k(scaled_logits, top_k, vocab_start, group)
        choice = vocab_parallel_sample(top_p_filter(values, top_p), uniform)
        return ids.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
    if top_p < 1.0:
        if _world(group) > 1:
            return vocab_parallel_sample(top_p_filter(gather_vocab(scaled_logits, group), top_p), uniform)
        scaled_logits = top_p_filter(scaled_logits, top_p)
    return vocab_parallel_sample(scaled_logits, uniform, vocab_start, group)
