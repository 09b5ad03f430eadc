"""Padding-free batches: several sequences laid end to end in one row, each attending only to itself.

A padded batch gives every sequence its own row, right-padded to the longest: the padding costs
the same FLOPs as real tokens. A packed batch lays the sequences end to end in rows of at most
`row_length` tokens (first fit, longest first), so the only padding left is the tail of each row.
Each sequence keeps its own positions (0, 1, ... from its first token) and attends only to its own
earlier tokens, so every token's logits are the same function of the same tokens as in the padded
layout (equal up to float rounding of sums of different lengths).

How attention is kept inside each sequence is the one thing that differs between implementations,
and it is decided here (`packed_forward`):
- megatron-core's local attention (CPU, and GPUs without transformer-engine) takes a full
  block-diagonal causal mask [rows, 1, L, L]; its cost stays O(L^2) per row, as a padded row of
  length L would cost.
- transformer-engine attention takes the THD format instead: all rows flattened into one sequence
  dimension with `PackedSeqParams` cu_seqlens (each row's tail padding counted as a sequence of
  its own), so the kernel never computes the blocks outside each sequence.
Packing needs a single pipeline stage (`packs_here`): a schedule sends activations of one fixed
shape between stages, so at PP > 1 batches stay padded.

Token-budget micro batches (`micro_batch_tokens`, `plan_token_budget`): instead of a fixed number of
sequences (or pairs) per micro batch, the global batch is split across the data-parallel ranks so
their token totals are balanced (longest first, each to the rank with the fewest tokens), and each
rank's share is cut into micro batches whose packed rows hold at most `micro_batch_tokens` tokens
(first fit, longest first; the rows are those the micro batch is laid out in: `first_fit_rows` of its
sequences, or with shared prompts `shared_prompt_rows`, a prompt held once per row). Every
rank then runs the same number of micro batches (megatron's schedule and the gradient sync expect
it): the largest ones are split, and where nothing is left to split a rank runs empty micro
batches (`empty_packed_rows`), whose loss and gradient are exactly zero.

Shared prompts (`SharedPromptPackingSection.share_prompts`, `shared_prompt_rows`): the sequences of
one prompt laid in one row (a GRPO/RLOO group's samples, a DPO pair's chosen and rejected) hold the
prompt once, then each response, every response token attending to the prompt and its own response
only, at the positions it has in its own sequence; the prompt's last position predicts every
response's first token. The model then runs over the prompt once instead of once per sequence. Such a
row is a tree, not a chain of sequences: only the full mask of the local path expresses it (THD's
cu_seqlens cannot), so `shares_prompts_here` says no on transformer-engine attention. Rows holding
groups are longer, so callers that double the default row length cut each micro batch's rows to the
longest of them (`pack_rows(trim=True)`).

megatron-core 0.16's GPTModel builds rotary embeddings for columns 0..S-1 whatever the position
ids say; `gpt_model_class` returns a GPTModel whose rotary embedding follows `position_ids`
instead, so the angles of a packed sequence's tokens are exactly those of its padded row.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from aligner.config import at_least
from aligner.models.deferred_output import HiddenStates
from aligner.runtime.errors import ConfigError


@dataclass
class PackingSection:
    """The `packing:` section of a config: how training and logprob batches are laid out."""

    enabled: bool = True  # false: one right-padded row per sequence
    # Tokens per packed row; null: the longest row the padded layout would use (so attention, O(L^2)
    # per row on the local path, never costs more per row than padding did).
    row_length: Optional[int] = None
    # Tokens per micro batch: the global batch balanced across data-parallel ranks by tokens and cut
    # into micro batches whose packed rows (tail padding included) hold at most this many (at least
    # one row); null: trainer.micro_batch_size sequences (pairs) per micro batch.
    micro_batch_tokens: Optional[int] = at_least(1, None, "null: trainer.micro_batch_size per micro batch")

    def __post_init__(self):
        if self.row_length is not None and self.row_length < 2:
            raise ConfigError(f"packing.row_length must be at least 2 tokens, got {self.row_length}")
        if self.micro_batch_tokens is not None and not self.enabled:
            raise ConfigError("packing.micro_batch_tokens forms packed micro batches: it needs packing.enabled=true")

    def check_layout(self, pipeline_model_parallel_size: int, longest_row: int, longest_row_is: str,
                     expert_model_parallel_size: int = 1) -> None:
        """Token budgets lay out packed rows, which a pipeline schedule (PP > 1) cannot send nor experts
        split over ranks gather (EP > 1: equal token counts per rank), and a micro batch holds at least
        one packed row (`longest_row` tokens, the default row length)."""
        budget = self.micro_batch_tokens
        if budget is None:
            return
        if pipeline_model_parallel_size > 1:
            raise ConfigError("packing.micro_batch_tokens needs parallel.pipeline_model_parallel_size=1 (a pipeline "
                              "schedule sends one activation shape; packed micro batches vary)")
        if expert_model_parallel_size > 1:
            raise ConfigError("packing.micro_batch_tokens needs parallel.expert_model_parallel_size=1 (the experts' "
                              "allgather dispatcher needs as many tokens on every rank; budgeted micro batches vary)")
        row = self.row_length or longest_row
        if budget < row:
            raise ConfigError(f"packing.micro_batch_tokens={budget} must hold one packed row: at least "
                              f"{'packing.row_length' if self.row_length else longest_row_is} = {row}")


@dataclass
class SharedPromptPackingSection(PackingSection):
    """The `packing:` section of the RL actor and DPO: PackingSection, and whether sequences of one
    prompt (a prompt's samples; a pair's chosen and rejected) share it in a packed row."""

    # Sequences of one prompt packed in one row hold the prompt once (the model runs over it once, not
    # once per sequence); local attention only (transformer-engine's THD packing cannot express it).
    share_prompts: bool = True


# ----------------------------------------------------------------------------- layout
def first_fit_rows(lengths: Sequence[int], row_length: int) -> list[list[int]]:
    """Sequence indices per row: first fit, longest first (ties by index, so every rank agrees)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        if length > row_length:
            raise ValueError(f"a sequence of {length} tokens does not fit a packed row of {row_length}")
        target = next((row for row, space in enumerate(free) if space >= length), None)
        if target is None:
            rows.append([])
            free.append(row_length)
            target = len(rows) - 1
        rows[target].append(index)
        free[target] -= length
    return rows


@dataclass
class PackedRows:
    """Sequences laid end to end in rows: tokens [R, L]; per sequence i (in the caller's order) it
    starts at flat column `starts[i]` (row * L + column) and is `lengths[i]` tokens long."""

    tokens: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L]: 0.. from each sequence's first token; padding counts on
    segment_ids: torch.Tensor  # [R, L]: the sequence's index in its row, -1 on padding
    starts: torch.Tensor  # [N] long
    lengths: torch.Tensor  # [N] long
    # Shared prompts (`pack_rows` with prompt_lengths): the segment each token also attends to (a shared
    # prompt's; else its own) [R, L], and per sequence the flat column of its first response token and
    # its prompt's length [N]. None: every sequence laid out whole, from `starts`.
    prefix_ids: Optional[torch.Tensor] = None
    response_starts: Optional[torch.Tensor] = None
    prompt_lengths: Optional[torch.Tensor] = None

    @property
    def row_length(self) -> int:
        return self.tokens.shape[1]

    @property
    def shares_prompts(self) -> bool:
        return self.response_starts is not None

    @property
    def real_tokens(self) -> int:
        """Tokens the rows hold, padding not counted (a shared prompt once)."""
        return int((self.segment_ids >= 0).sum())

    def sequence(self, index: int) -> torch.Tensor:
        """The tokens of sequence `index` (in the caller's order), as laid out in the rows (shared
        prompts: its prompt, then its response)."""
        start, length = int(self.starts[index]), int(self.lengths[index])
        flat = self.tokens.reshape(-1)
        if not self.shares_prompts:
            return flat[start:start + length]
        prompt_length, response = int(self.prompt_lengths[index]), int(self.response_starts[index])
        return torch.cat([flat[start:start + prompt_length], flat[response:response + length - prompt_length]])

    def to(self, device, non_blocking: bool = False) -> "PackedRows":
        return PackedRows(*(None if tensor is None else tensor.to(device, non_blocking=non_blocking) for tensor in (
            self.tokens, self.position_ids, self.segment_ids, self.starts, self.lengths, self.prefix_ids,
            self.response_starts, self.prompt_lengths)))

    def attention_mask(self) -> torch.Tensor:
        """[R, 1, L, L] bool, True = masked: causal within each sequence (a shared prompt's responses:
        within the prompt and their own tokens); padding sees only itself."""
        columns = torch.arange(self.row_length, device=self.tokens.device)
        causal = columns[None, :] <= columns[:, None]  # key <= query
        segments = self.segment_ids
        same = segments[:, :, None] == segments[:, None, :]
        if self.prefix_ids is not None:
            same |= self.prefix_ids[:, :, None] == segments[:, None, :]
        attend = causal & same & (segments >= 0)[:, :, None]
        attend |= torch.eye(self.row_length, dtype=torch.bool, device=self.tokens.device)  # no empty softmax row
        return ~attend[:, None]

    def packed_seq_params(self):
        """megatron's THD parameters for the rows flattened to one sequence (tail padding a sequence too)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        if self.shares_prompts:
            raise ValueError("rows with shared prompts need a full attention mask; THD sequences cannot express them")

        segments = self.segment_ids.reshape(-1)
        flat = torch.arange(1, len(segments), device=segments.device)
        starts = (flat % self.row_length == 0) | (segments[1:] != segments[:-1])  # a row or a sequence begins
        cu_seqlens = torch.cat([flat.new_zeros(1), flat[starts], flat.new_full((1,), len(segments))]).to(torch.int32)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                               max_seqlen_q=longest, max_seqlen_kv=longest)


def pack_rows(sequences: Sequence[torch.Tensor], row_length: int, pad_id: int,
              rows: Optional[list[list[int]]] = None,
              prompt_lengths: Optional[Sequence[int]] = None, trim: bool = False) -> PackedRows:
    """Lay 1-D token tensors end to end in rows of `row_length` (rows: the plan, default `first_fit_rows`);
    trim: rows only as long as the longest of them needs (no columns of padding in every row).

    prompt_lengths: the sequences' prompt lengths, to share prompts: a sequence whose prompt equals
    that of the group started by an earlier sequence of its row, adjacent in the plan (as
    `shared_prompt_rows` places them), lays out only its response after the group's, attending to the
    group's prompt (`PackedRows.prefix_ids`)."""
    lengths = [len(sequence) for sequence in sequences]
    rows = first_fit_rows(lengths, row_length) if rows is None else rows
    tokens = torch.full((len(rows), row_length), pad_id, dtype=torch.long)
    segment_ids = torch.full((len(rows), row_length), -1, dtype=torch.long)
    position_ids = torch.empty((len(rows), row_length), dtype=torch.long)
    starts = torch.zeros(len(sequences), dtype=torch.long)
    shared = prompt_lengths is not None
    prefix_ids = torch.full((len(rows), row_length), -1, dtype=torch.long) if shared else None
    response_starts = torch.zeros(len(sequences), dtype=torch.long) if shared else None
    column = segment = row = 0

    def lay(values: torch.Tensor, first_position: int, prefix: int) -> int:
        """Lays `values` at the row's next column (positions from first_position); returns its flat column."""
        nonlocal column, segment
        if column + len(values) > row_length:
            raise ValueError(f"the sequences of packed row {row} need more than {row_length} tokens")
        span = slice(column, column + len(values))
        tokens[row, span] = values
        segment_ids[row, span] = segment
        position_ids[row, span] = torch.arange(first_position, first_position + len(values))
        if shared:
            prefix_ids[row, span] = prefix
        first = row * row_length + column
        column, segment = column + len(values), segment + 1
        return first

    for row, members in enumerate(rows):
        column, segment, group = 0, 0, None  # group: (prompt tokens, its segment, its flat start)
        for index in members:
            sequence = torch.as_tensor(sequences[index], dtype=torch.long)
            if not shared:
                starts[index] = lay(sequence, 0, -1)
                continue
            prompt_length = int(prompt_lengths[index])
            prompt = sequence[:prompt_length]
            if group is None or not torch.equal(group[0], prompt):
                group = (prompt, segment, lay(prompt, 0, segment))
            starts[index] = group[2]
            response_starts[index] = lay(sequence[prompt_length:], prompt_length, group[1])
        position_ids[row, column:] = torch.arange(row_length - column)
    if trim and len(rows):
        used = int((segment_ids >= 0).sum(1).max())
        tokens, position_ids, segment_ids = tokens[:, :used], position_ids[:, :used], segment_ids[:, :used]
        prefix_ids = None if prefix_ids is None else prefix_ids[:, :used]
        starts = starts // row_length * used + starts % row_length
        if shared:
            response_starts = response_starts // row_length * used + response_starts % row_length
    return PackedRows(tokens.contiguous(), position_ids.contiguous(), segment_ids.contiguous(), starts,
                      torch.tensor(lengths, dtype=torch.long), None if prefix_ids is None else prefix_ids.contiguous(),
                      response_starts,
                      torch.tensor([int(n) for n in prompt_lengths], dtype=torch.long) if shared else None)


def shared_prompt_parts(lengths: Sequence[int], prompt_lengths: Sequence[int], prompt_keys: Sequence,
                        row_length: int) -> list[list[int]]:
    """Sequence indices per part: the sequences of one prompt (equal `prompt_keys`) cut into parts whose
    prompt once plus their responses fit a row (first fit, longest response first)."""
    groups: dict = {}
    for index, key in enumerate(prompt_keys):
        groups.setdefault((int(prompt_lengths[index]), key), []).append(index)
    parts: list[list[int]] = []
    for (prompt_length, _), members in groups.items():
        responses = [lengths[i] - prompt_length for i in members]
        parts += [sorted(members[i] for i in part) for part in first_fit_rows(responses, row_length - prompt_length)]
    return parts


def shared_tokens(lengths: Sequence[int], prompt_lengths: Sequence[int], prompt_keys: Sequence) -> int:
    """Tokens of the sequences with each distinct prompt counted once: what rows sharing prompts hold at
    the least (a prompt split over two rows is held twice)."""
    prompts = {(int(length), key): int(length) for length, key in zip(prompt_lengths, prompt_keys)}
    return sum(lengths) - sum(int(length) for length in prompt_lengths) + sum(prompts.values())


def shared_prompt_rows(lengths: Sequence[int], prompt_lengths: Sequence[int], prompt_keys: Sequence,
                       row_length: int, no_more_rows: bool = False) -> list[list[int]]:
    """Sequence indices per row, the sequences of one prompt (equal `prompt_keys`) adjacent: each group
    is cut into parts whose prompt once plus their responses fit a row (first fit, longest response
    first), and the parts are laid out as `first_fit_rows` lays out sequences. `pack_rows` with the
    prompt lengths then shares each part's prompt. no_more_rows: `first_fit_rows` of the sequences
    where that needs fewer rows (first fit of smaller parts can, rarely, take more); token budgets plan
    and pack their micro batches with it (`packed_rows_plan`)."""
    parts = shared_prompt_parts(lengths, prompt_lengths, prompt_keys, row_length)
    # a part: its prompt once, then its responses
    sizes = [int(prompt_lengths[part[0]]) + sum(lengths[i] - int(prompt_lengths[i]) for i in part) for part in parts]
    shared = [[index for part in row for index in parts[part]] for row in first_fit_rows(sizes, row_length)]
    if no_more_rows:
        unshared = first_fit_rows(lengths, row_length)
        return unshared if len(unshared) < len(shared) else shared
    return shared


def empty_packed_rows(pad_id: int) -> PackedRows:
    """A micro batch of no sequences: one row of one padding token (the forward runs; nothing is read)."""
    zero = torch.zeros((1, 1), dtype=torch.long)
    return PackedRows(torch.full((1, 1), pad_id, dtype=torch.long), zero, zero - 1,
                      torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))


def zero_loss(output: torch.Tensor) -> torch.Tensor:
    """The loss of an empty micro batch: exactly 0, with an exactly-zero gradient through the graph."""
    return (output.tensor if isinstance(output, HiddenStates) else output).sum() * 0.0


# ----------------------------------------------------------------------------- token budgets
def balanced_partition(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Item indices per part (ascending), the totals balanced: longest first, each to the part with
    the fewest tokens so far (ties: the lower part). The largest total minus the smallest is at most
    the largest item (the item that made a part the largest went to the smallest one)."""
    totals, members = [0] * parts, [[] for _ in range(parts)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        part = min(range(parts), key=lambda p: (totals[p], p))
        members[part].append(index)
        totals[part] += sizes[index]
    return [sorted(part) for part in members]


class _BudgetItems:
    """Items of a token budget (an item: the lengths of its sequences, kept in one micro batch) and how
    any of them lay out together: `packed_rows_plan` of their sequences, with `prompts` (per item, per
    sequence its (prompt length, prompt key)) sharing prompts as the packing of the micro batch will."""

    def __init__(self, items: Sequence[Sequence[int]], row_length: int,
                 prompts: Optional[Sequence[Sequence[tuple[int, Any]]]] = None):
        self.items, self.row_length, self.prompts = items, row_length, prompts
        self.sizes = [self.lower_bound([index]) for index in range(len(items))]

    def _sequences(self, indices: Sequence[int]) -> tuple[list[int], Optional[tuple[list[int], list]]]:
        """(lengths, (prompt lengths, prompt keys) or None) of the items' sequences, in order."""
        lengths = [n for i in indices for n in self.items[i]]
        if self.prompts is None:
            return lengths, None
        prompts = [prompt for i in indices for prompt in self.prompts[i]]
        return lengths, ([length for length, _ in prompts], [key for _, key in prompts])

    def cells(self, indices: Sequence[int]) -> int:
        """Tokens of the packed rows (tail padding included) that hold the items `indices`."""
        lengths, prompts = self._sequences(indices)
        return len(packed_rows_plan(lengths, self.row_length, prompts, no_more_rows=True)) * self.row_length

    def lower_bound(self, indices: Sequence[int]) -> int:
        """At most `cells(indices)`, cheaper: the items' tokens, a shared prompt once."""
        lengths, prompts = self._sequences(indices)
        return sum(lengths) if prompts is None else shared_tokens(lengths, *prompts)

    def micro_batches(self, indices: Sequence[int], budget: int) -> list[list[int]]:
        """The items `indices` (a list of this layout's items) cut into micro batches whose packed rows
        hold at most `budget` tokens: first fit, largest item first (ties: earlier in `indices`); an item
        that alone needs more is alone in its micro batch."""
        batches: list[list[int]] = []
        for _, index in sorted(enumerate(indices), key=lambda pair: (-self.sizes[pair[1]], pair[0])):
            target = next((b for b, batch in enumerate(batches)
                           if self.lower_bound(batch + [index]) <= budget  # cheap bound first: cells >= tokens
                           and self.cells(batch + [index]) <= budget), None)
            if target is None:
                batches.append([])
                target = len(batches) - 1
            batches[target].append(index)
        return batches


def token_budget_micro_batches(items: Sequence[Sequence[int]], budget: int, row_length: int,
                               prompts: Optional[Sequence[Sequence[tuple[int, Any]]]] = None) -> list[list[int]]:
    """Item indices per micro batch (an item: the lengths of its sequences, e.g. a pair's two), each
    micro batch's packed rows (`packed_rows_plan` of its sequences; with `prompts`, per item per sequence
    its (prompt length, key), sharing prompts) holding at most `budget` tokens (`_BudgetItems.micro_batches`)."""
    return _BudgetItems(items, row_length, prompts).micro_batches(range(len(items)), budget)


def even_micro_batch_counts(per_rank: list[list[list[int]]], items: Sequence[Sequence[int]], budget: int,
                            row_length: int, prompts: Optional[Sequence[Sequence[tuple[int, Any]]]] = None
                            ) -> list[list[list[int]]]:
    """Every rank's micro batches made as many as the most any rank has: the rank's largest micro
    batch (in tokens) of two or more items is split in two halves balanced by tokens (each re-cut to
    the budget, should first fit lay a half out worse than the whole), again and again; with nothing
    left to split, empty micro batches ([]) fill the count. `prompts` as in `token_budget_micro_batches`."""
    layout = _BudgetItems(items, row_length, prompts)
    sizes = layout.sizes
    evened = [[list(batch) for batch in batches] for batches in per_rank]
    while len({len(batches) for batches in evened}) > 1:
        target = max(len(batches) for batches in evened)
        for batches in evened:
            while len(batches) < target:
                splittable = [b for b, batch in enumerate(batches) if len(batch) > 1]
                if not splittable:
                    batches.extend([] for _ in range(target - len(batches)))
                    break
                largest = max(splittable, key=lambda b: (sum(sizes[i] for i in batches[b]), -b))
                batch = batches[largest]
                parts = []
                for half in balanced_partition([sizes[i] for i in batch], 2):
                    parts += layout.micro_batches([batch[i] for i in half], budget)
                batches[largest:largest + 1] = parts
    return evened


def plan_token_budget(items: Sequence[Sequence[int]], ranks: int, budget: int, row_length: int,
                      prompts: Optional[Sequence[Sequence[tuple[int, Any]]]] = None) -> list[list[list[int]]]:
    """[rank][micro batch] -> item indices of a global batch (an item: the lengths of its sequences):
    the items balanced across ranks by tokens, each rank's share cut into micro batches whose packed
    rows of `row_length` hold at most `budget` tokens, every rank with the same number of micro
    batches (some possibly empty). With `prompts` (per item, per sequence its (prompt length, prompt
    key)) a micro batch's sequences of one prompt hold it once, as `packed_rows_plan` lays them out:
    tokens and rows are counted so."""
    layout = _BudgetItems(items, row_length, prompts)
    shares = balanced_partition(layout.sizes, ranks)
    per_rank = [layout.micro_batches(share, budget) for share in shares]
    return even_micro_batch_counts(per_rank, items, budget, row_length, prompts)


# ----------------------------------------------------------------------------- the forward
def uses_thd_attention(model: torch.nn.Module) -> bool:
    """Whether the chunk's attention is transformer-engine's (takes THD packed sequences)."""
    cached = getattr(model, "_aligner_thd_attention", None)
    if cached is None:
        cached = any(type(module).__name__ == "TEDotProductAttention" for module in model.modules())
        model._aligner_thd_attention = cached
    return cached


def packed_forward(model: torch.nn.Module, packed: PackedRows) -> torch.Tensor:
    """The chunk's output [R, L, ...] (logits, or a reward model's scores) for packed rows."""
    if not uses_thd_attention(model):
        return model(packed.tokens, packed.position_ids, packed.attention_mask())
    # transformer-engine: the rows as one sequence [1, R * L] cut by cu_seqlens (megatron switches its
    # mask to padding_causal and rotates each sequence from position 0). Packing runs on one pipeline
    # stage (`packs_here`), so the output is the logits [1, R * L, ...].
    rows, length = packed.tokens.shape
    output = model(packed.tokens.reshape(1, -1), packed.position_ids.reshape(1, -1), None,
                   packed_seq_params=packed.packed_seq_params())
    return output.reshape(rows, length, *output.shape[2:])


def token_scores_at(output: torch.Tensor, packed: PackedRows, columns: torch.Tensor) -> torch.Tensor:
    """output [R, L, ...] at each sequence's own column `columns` [N] -> [N, ...]."""
    if packed.shares_prompts:
        raise ValueError("token_scores_at reads whole sequences; rows with shared prompts split them")
    flat = packed.starts.to(output.device) + columns.to(output.device)
    return output.reshape(-1, *output.shape[2:]).index_select(0, flat)


# ----------------------------------------------------------------------------- rotary positions
def rotary_embedding_at(rotary, position_ids: torch.Tensor) -> torch.Tensor:
    """megatron's rotary embedding [S, B, 1, dim] at each row's own positions ([B, S]), computed as
    `RotaryEmbedding.get_emb` does for columns (the same products, so equal positions give equal bits).
    A `LocalGlobalRotaryEmbedding` gives both its embeddings side by side, as its forward does."""
    local = getattr(rotary, "local", None)
    own = _rotary_embedding_at(rotary, position_ids)
    return own if local is None else torch.cat([own, _rotary_embedding_at(local, position_ids)], dim=-1)


def _rotary_embedding_at(rotary, position_ids: torch.Tensor) -> torch.Tensor:
    inv_freq = rotary.inv_freq.to(position_ids.device)
    seq = position_ids.t().to(inv_freq.dtype)  # [S, B]
    if rotary.seq_len_interpolation_factor is not None:
        seq = seq * (1 / rotary.seq_len_interpolation_factor)
    freqs = seq.unsqueeze(-1) * inv_freq  # [S, B, dim / 2]
    if not rotary.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
    return emb.unsqueeze(2)


@functools.lru_cache(maxsize=None)
def gpt_model_class():
    """megatron-core's GPTModel, with rotary embeddings at `position_ids` (its own: at columns)."""
    from megatron.core.models.gpt import GPTModel

    class GPTModelWithRowPositions(GPTModel):
        def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                        packed_seq_params=None, padding_mask=None):
            output = super()._preprocess(input_ids=input_ids, position_ids=position_ids, decoder_input=decoder_input,
                                         inference_context=inference_context, packed_seq_params=packed_seq_params,
                                         padding_mask=padding_mask)
            # Rows sharing one position vector (an expanded arange) keep megatron's own table; the
            # THD format and the KV-cached path count positions themselves.
            if (output[1] is None or position_ids is None or packed_seq_params is not None
                    or inference_context is not None or position_ids.stride(0) == 0):
                return output
            return (output[0], rotary_embedding_at(self.rotary_pos_emb, position_ids), *output[2:])

        def _postprocess(self, **kwargs):
            # megatron's own loss (labels given) changes the logits in place: a batch-major output layer
            # (aligner.models.layers) then computes them in megatron's order, as a tensor of their own.
            output_layer = self._modules.get("output_layer")  # none before the last pipeline stage
            if hasattr(output_layer, "batch_major"):
                output_layer.batch_major = kwargs.get("labels") is None
            return super()._postprocess(**kwargs)

    return GPTModelWithRowPositions


# ----------------------------------------------------------------------------- logprob passes
def packs_here(packing: Optional[PackingSection]) -> bool:
    """Whether batches are packed at this layout: asked for, one pipeline stage (a pipeline schedule
    sends activations of one fixed [rows, length] shape between stages), and experts not split over
    ranks (megatron's allgather dispatcher gathers equally many tokens from each rank; packed rows
    hold as many as each rank's sequences need)."""
    from megatron.core import parallel_state as ps

    return (packing is not None and packing.enabled and ps.get_pipeline_model_parallel_world_size() == 1
            and ps.get_expert_model_parallel_world_size() == 1)


def packed_rows_plan(lengths: Sequence[int], row_length: int,
                     prompts: Optional[tuple[Sequence[int], Sequence]] = None,
                     no_more_rows: bool = False) -> list[list[int]]:
    """Sequence indices per row: `first_fit_rows`, or with prompts given as (prompt lengths, prompt keys)
    `shared_prompt_rows` (no_more_rows as there)."""
    if prompts is None:
        return first_fit_rows(lengths, row_length)
    return shared_prompt_rows(lengths, *prompts, row_length, no_more_rows=no_more_rows)


def plan_micro_batches(lengths: Sequence[int], row_length: int, rows_per_micro_batch: int,
                       prompts: Optional[tuple[Sequence[int], Sequence]] = None) -> list[list[list[int]]]:
    """Sequence indices per row per micro batch: `packed_rows_plan`, then `rows_per_micro_batch` rows at a time."""
    rows = packed_rows_plan(lengths, row_length, prompts)
    return [rows[start:start + rows_per_micro_batch] for start in range(0, len(rows), rows_per_micro_batch)]


def pack_micro_batch(sequences: Sequence[torch.Tensor], rows: list[list[int]], row_length: int,
                     pad_id: int, prompt_lengths: Optional[Sequence[int]] = None,
                     trim: bool = False) -> tuple[list[int], PackedRows]:
    """(members, packed): the sequences named in `rows` (indices into `sequences`) as packed rows,
    their order in `packed` being `members`; with `prompt_lengths` (of every sequence) prompts are
    shared, and `trim` cuts the rows to the longest (`pack_rows`)."""
    members = [index for row in rows for index in row]
    local, position = [], 0
    for row in rows:
        local.append(list(range(position, position + len(row))))
        position += len(row)
    return members, pack_rows([sequences[index] for index in members], row_length, pad_id, rows=local,
                              prompt_lengths=None if prompt_lengths is None
                              else [prompt_lengths[index] for index in members], trim=trim)


def shares_prompts_here(packing: Optional[PackingSection], model: torch.nn.Module) -> bool:
    """Whether packed rows share prompts: asked for, packing here, and the local path's full mask
    (transformer-engine's THD sequences cannot hold a tree)."""
    return (packs_here(packing) and getattr(packing, "share_prompts", False)
            and not uses_thd_attention(model))


def prompt_keys(tokens: torch.Tensor, prompt_lengths: torch.Tensor) -> list[tuple]:
    """Per right-padded row of `tokens` [B, S], its prompt's tokens (rows of one prompt: equal keys)."""
    return [tuple(row[:length].tolist()) for row, length in zip(tokens.cpu(), prompt_lengths.tolist())]


def pack_padded(tokens: torch.Tensor, lengths: torch.Tensor, row_length: Optional[int], pad_id: int,
                prompt_lengths: Optional[torch.Tensor] = None, budgeted: bool = False) -> PackedRows:
    """Right-padded rows tokens [B, S] with real lengths [B], packed into rows of row_length (default S),
    on the tokens' device. With `prompt_lengths` [B] rows of one prompt share it (`shared_prompt_rows`):
    row_length null then means rows of up to 2 S (S under a token budget, `budgeted`) cut to the longest."""
    sequences = [row[:length] for row, length in zip(tokens.cpu(), lengths.tolist())]
    if prompt_lengths is None:
        return pack_rows(sequences, row_length or tokens.shape[1], pad_id).to(tokens.device)
    capacity = row_length or tokens.shape[1] * (1 if budgeted else 2)
    prompt_lengths = prompt_lengths.cpu()
    rows = shared_prompt_rows(lengths.tolist(), prompt_lengths.tolist(), prompt_keys(tokens, prompt_lengths),
                              capacity, no_more_rows=budgeted)
    return pack_rows(sequences, capacity, pad_id, rows=rows, prompt_lengths=prompt_lengths.tolist(),
                     trim=row_length is None).to(tokens.device)


def packed_rows_of(batch: dict, lengths: torch.Tensor, packing: Optional[PackingSection],
                   pad_id: int, prompt_lengths: Optional[torch.Tensor] = None) -> Optional[PackedRows]:
    """A collated micro batch's sequences (lengths [B]) as packed rows, built once and kept in
    batch["packed"] (its forward and its loss read the same rows); None where `packs_here` says no.
    A micro batch of no rows (evening a token-budget plan) runs `empty_packed_rows`. Given the rows'
    `prompt_lengths`, rows of one prompt share it where packing.share_prompts says so (the builder
    turns it off where the model's attention cannot: `shares_prompts_here`)."""
    if not packs_here(packing):
        return None
    if "packed" not in batch:
        tokens = batch["tokens"]
        shared = prompt_lengths if getattr(packing, "share_prompts", False) else None
        batch["packed"] = (pack_padded(tokens, lengths, packing.row_length, pad_id, shared,
                                       budgeted=packing.micro_batch_tokens is not None) if len(tokens)
                           else empty_packed_rows(pad_id).to(tokens.device))
    return batch["packed"]


def forward_batch(model: torch.nn.Module, batch: dict, packed: Optional[PackedRows]) -> torch.Tensor:
    """A collated micro batch through the chunk: packed rows, or its padded tokens and position ids."""
    if packed is not None:
        return packed_forward(model, packed)
    return model(batch["tokens"], batch["position_ids"], None)
