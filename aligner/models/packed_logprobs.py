"""Response logprobs of right-padded rollouts computed on packed rows (`aligner.models.packing`).

The same numbers as `aligner.models.logprobs.sequence_logprobs` (the padded pass, which this
falls back to where packing is off or not possible), with no FLOPs spent on padding.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from aligner.models import logprobs
from aligner.models.deferred_output import forward_deferred
from aligner.models.packing import (
    PackedRows,
    PackingSection,
    pack_micro_batch,
    packed_forward,
    packs_here,
    plan_micro_batches,
    prompt_keys,
)
from aligner.runtime.distributed import device


def response_logprobs_and_entropy(
    logits: torch.Tensor,
    packed: PackedRows,
    prompt_lengths: torch.Tensor,
    response_lengths: torch.Tensor,
    *,
    vocab_size: int,
    response_width: int,
    temperature: float = 1.0,
    entropy_grad: bool = True,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logprobs.response_logprobs_and_entropy` of the sequences of packed rows, read in place from
    the packed logits [R, L, vocab_shard] or `HiddenStates` (no per-sequence copy): [N, response_width] each, 0 after
    each response's end. With shared prompts the prompt's last column predicts every response's first token."""
    device = logits.device
    row_length = logits.shape[1]
    inside = logprobs.response_mask(response_lengths.to(device), response_width)
    steps = torch.arange(response_width, device=device)
    prompt_end = packed.starts.to(device) + prompt_lengths.to(device)  # one past each prompt's last token
    first = packed.response_starts.to(device) if packed.shares_prompts else prompt_end
    # Flat column of response token j of sequence i, and of the logits predicting it.
    token = (first.unsqueeze(1) + steps)[inside]
    flat = first.unsqueeze(1) + steps - 1
    if response_width:
        flat[:, 0] = prompt_end - 1
    flat = flat[inside]
    targets = packed.tokens.to(device).reshape(-1)[token]
    selected, entropy = logprobs.selected_logprobs_and_entropy(
        logits, flat // row_length, flat % row_length, targets, vocab_size=vocab_size, temperature=temperature,
        with_entropy=with_entropy)
    if not (entropy_grad and with_entropy):
        entropy = entropy.detach()
    zeros = logits.new_zeros(inside.shape, dtype=torch.float32)
    return zeros.masked_scatter(inside, selected), zeros.masked_scatter(inside, entropy)


@torch.no_grad()
def packed_sequence_logprobs(
    model: torch.nn.Module,
    packed: PackedRows,
    prompt_lengths: torch.Tensor,
    response_lengths: torch.Tensor,
    *,
    vocab_size: int,
    response_width: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Response logprobs [N, response_width] of the N sequences of `packed` (on the model's device),
    one forward of the chunk (one pipeline stage: `packs_here`)."""
    model.eval()
    logprobs, _ = response_logprobs_and_entropy(
        forward_deferred(model, packed_forward, packed), packed, prompt_lengths, response_lengths,
        vocab_size=vocab_size, temperature=temperature, response_width=response_width, with_entropy=False)
    return logprobs


@torch.no_grad()
def sequence_logprobs(
    model_chunks: Sequence[torch.nn.Module],
    tokens: torch.Tensor,
    prompt_lengths: torch.Tensor,
    response_lengths: torch.Tensor,
    *,
    vocab_size: int,
    packing: Optional[PackingSection],
    pad_id: int,
    temperature: float = 1.0,
    response_width: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    plan: Optional[list[list[list[int]]]] = None,
    row_length: Optional[int] = None,
    share_prompts: bool = False,
    trim: bool = False,
) -> torch.Tensor:
    """`aligner.models.logprobs.sequence_logprobs` of right-padded rows tokens [B, S], computed on
    packed rows when `packs_here(packing)` (rows of `row_length`, default packing.row_length, else S; micro_batch_size
    packed rows per forward), else on the padded rows themselves.

    plan: the packed forwards, as row indices per packed row per forward (default: first fit over
    the whole batch). Where a sequence sits in a row changes its float rounding (~1e-6 relative), so
    a caller that needs bit-equal numbers later lays the rows out the same way both times.
    share_prompts: rows of one prompt hold it once (`packing.shared_prompt_rows`; the caller checks
    `packing.shares_prompts_here`); trim: each forward's rows cut to the longest of them (`packing.pack_rows`)."""
    width = int(response_lengths.max()) if response_width is None else response_width
    if not packs_here(packing):
        return logprobs.sequence_logprobs(model_chunks, tokens, prompt_lengths, response_lengths,
                                          vocab_size=vocab_size, temperature=temperature, response_width=width,
                                          micro_batch_size=micro_batch_size)
    target = device()
    lengths = (prompt_lengths + response_lengths).tolist()
    sequences = [tokens[row, :length] for row, length in enumerate(lengths)]
    row_length = row_length or packing.row_length or tokens.shape[1]
    result = torch.zeros(len(sequences), width, device=target)
    shared_lengths = prompt_lengths.tolist() if share_prompts else None
    if not plan:
        prompts = (shared_lengths, prompt_keys(tokens, prompt_lengths)) if share_prompts else None
        plan = plan_micro_batches(lengths, row_length, micro_batch_size or len(sequences), prompts)
    for rows in plan:
        members, packed = pack_micro_batch(sequences, rows, row_length, pad_id, shared_lengths, trim=trim)
        index = torch.tensor(members, device=target)
        result[index] = packed_sequence_logprobs(
            model_chunks[0], packed.to(target), prompt_lengths.to(target)[index], response_lengths.to(target)[index],
            vocab_size=vocab_size, temperature=temperature, response_width=width)
    return result
