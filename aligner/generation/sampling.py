"""Token selection for generation: filtering, logprobs, reproducible noise, vocab-parallel helpers.

Pure functions on tensors. Logits here are a tensor-parallel shard `[batch, vocab_shard]` whose
first entry is global token id `vocab_start`; with `group=None` (or a group of one) the shard is
the whole vocabulary and no collective runs.

Sampling is Gumbel-max: token = argmax(filtered_logits / temperature + g) with g ~ Gumbel(0, 1),
which is an exact draw from softmax(filtered_logits / temperature). The noise g comes from a
counter-based generator, a hash of (seed, sample index, step, global token id), so:
- a sample's draws depend only on its own index, never on the rest of the batch or its padding;
- every tensor-parallel rank computes the same noise for the same token id, so a shard needs only
  its own noise, and an argmax over per-shard winners (a [batch, 2] all-gather) is the sample;
- TP=1 and TP=2 pick the same tokens from the same logits.
Top-k (and top-p after top-k) work on per-shard top-k candidates gathered across ranks; only
top-p without top-k gathers the whole vocabulary (the nucleus may be any size).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

_MASK32 = 0xFFFFFFFF
# Odd 32-bit constants: the multipliers of the "lowbias32" integer hash (C. Wellons, hash
# prospector) and a few arbitrary odd salts that separate the streams (seed, sample, step, token).
_MUL_A, _MUL_B = 0x7FEB352D, 0x846CA68B
_SALT_SEED, _SALT_STEP, _SALT_TOKEN = 0x9E3779B9, 0x632BE5AB, 0x68E31DA4


# ----------------------------------------------------------------------------- filtering
def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in float32; temperature <= 0 (greedy) leaves the logits unscaled."""
    logits = logits.float()
    return logits / temperature if temperature > 0 and temperature != 1.0 else logits


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability reaches p.

    A token is dropped when the probability of the tokens ranked above it already reaches p, so
    the most likely token always stays. p >= 1: no-op.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[token] per row, in float32. logits [..., vocab]; tokens [...]."""
    logits = logits.float()
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


# ----------------------------------------------------------------------------- reproducible noise
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
    """One 32-bit key per sample from (seed, sample index): the sample's noise stream. [batch] int64."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"sampling seed must be in [0, 2**32), got {seed}")
    seed_key = _mix32(torch.tensor(seed ^ _SALT_SEED, dtype=torch.int64))
    return _mix32(seed_key ^ (sample_ids.to(torch.int64) & _MASK32))


def token_hashes(token_ids: torch.Tensor) -> torch.Tensor:
    """Per-token salt of the noise, computed once per vocabulary shard. [vocab_shard] int64."""
    return _mix32((token_ids.to(torch.int64) ^ _SALT_TOKEN) & _MASK32)


def step_keys(keys: torch.Tensor, steps) -> torch.Tensor:
    """Keys of generation step(s) `steps` (the step-th new token of every sample).

    steps: an int ([batch] result) or a [n] tensor of steps ([batch, n] result).
    """
    if isinstance(steps, int):
        return _mix32(keys ^ int(_mix32(torch.tensor((steps + _SALT_STEP) & _MASK32))))
    return _mix32(keys.unsqueeze(-1) ^ _mix32((steps.to(keys.device, torch.int64) + _SALT_STEP) & _MASK32))


def gumbel_noise(step_key: torch.Tensor, token_hash: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise, float32, for step keys and token hashes.

    step_key [batch] with token_hash [tokens] -> [batch, tokens]; step_key [batch, steps] with
    token_hash [tokens] -> [batch, steps, tokens] (several steps at once); step_key [batch] with
    token_hash [batch, tokens] (candidates that differ per row) -> [batch, tokens].
    Uniforms use the top 24 bits, u = (h + 0.5) / 2**24, strictly inside (0, 1): no infinities.
    """
    if token_hash.dim() == 1 and step_key.dim() == 1:
        token_hash = token_hash.unsqueeze(0)
    bits = _mix32(step_key.unsqueeze(-1) ^ token_hash) >> 8
    uniform = (bits.to(torch.float32) + 0.5) * (1.0 / 2**24)
    return -torch.log(-torch.log(uniform))


# ----------------------------------------------------------------------------- vocab-parallel helpers
def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    """[world, *tensor.shape]: every rank's tensor, stacked in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


def vocab_parallel_argmax(values: torch.Tensor, vocab_start: int, group=None) -> torch.Tensor:
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


def vocab_parallel_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_start: int,
                                  group=None) -> torch.Tensor:
    """log_softmax over the sharded vocabulary at global token ids `tokens` [batch], float32."""
    logits = logits.float()
    if _world(group) == 1:
        return token_logprobs(logits, tokens - vocab_start)
    local = tokens - vocab_start
    owned = (local >= 0) & (local < logits.shape[-1])
    chosen = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    chosen = torch.where(owned, chosen, torch.zeros_like(chosen))
    dist.all_reduce(chosen, group=group)
    return chosen - vocab_parallel_logsumexp(logits, group)


def vocab_parallel_top_k(logits: torch.Tensor, k: int, vocab_start: int, group=None):
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


def select_tokens(
    scaled_logits: torch.Tensor,
    *,
    greedy: bool,
    top_k: int = 0,
    top_p: float = 1.0,
    step_key: Optional[torch.Tensor] = None,
    token_hash: Optional[torch.Tensor] = None,
    shard_noise: Optional[torch.Tensor] = None,
    vocab_start: int = 0,
    group=None,
) -> torch.Tensor:
    """Next token ids [batch] from temperature-scaled logits of this shard [batch, vocab_shard].

    greedy: global argmax. Otherwise a Gumbel-max draw after top-k and top-p filtering, with noise
    from `step_key` [batch] and `token_hash` (token_hashes of this shard's global ids);
    shard_noise [batch, vocab_shard] may hand in gumbel_noise(step_key, token_hash) computed
    ahead (the engine makes it for several steps at once). Every rank of `group` returns the
    same tokens.
    """
    if greedy:
        return vocab_parallel_argmax(scaled_logits, vocab_start, group)
    if top_k > 0:
        values, ids = vocab_parallel_top_k(scaled_logits, top_k, vocab_start, group)
        values = top_p_filter(values, top_p)
        noisy = values + gumbel_noise(step_key, token_hashes(ids))
        return ids.gather(-1, noisy.argmax(dim=-1, keepdim=True)).squeeze(-1)
    if top_p < 1.0 and _world(group) > 1:
        full = top_p_filter(gather_vocab(scaled_logits, group), top_p)
        ids = torch.arange(full.shape[-1], device=full.device)
        return (full + gumbel_noise(step_key, token_hashes(ids))).argmax(dim=-1)
    if shard_noise is None:
        shard_noise = gumbel_noise(step_key, token_hash)
    return vocab_parallel_argmax(top_p_filter(scaled_logits, top_p) + shard_noise, vocab_start, group)
