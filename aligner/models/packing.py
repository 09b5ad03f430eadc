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

megatron-core 0.16's GPTModel builds rotary embeddings for columns 0..S-1 whatever the position
ids say; `gpt_model_class` returns a GPTModel whose rotary embedding follows `position_ids`
instead, so the angles of a packed sequence's tokens are exactly those of its padded row.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class PackingSection:
    """The `packing:` section of a config: how training and logprob batches are laid out."""

    enabled: bool = True  # false: one right-padded row per sequence
    # Tokens per packed row; null: the longest row the padded layout would use (so attention, O(L^2)
    # per row on the local path, never costs more per row than padding did).
    row_length: Optional[int] = None

    def __post_init__(self):
        if self.row_length is not None and self.row_length < 2:
            from aligner.runtime.errors import ConfigError

            raise ConfigError(f"packing.row_length must be at least 2 tokens, got {self.row_length}")


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

    @property
    def row_length(self) -> int:
        return self.tokens.shape[1]

    def sequence(self, index: int) -> torch.Tensor:
        """The tokens of sequence `index` (in the caller's order), as laid out in the rows."""
        start, length = int(self.starts[index]), int(self.lengths[index])
        return self.tokens.reshape(-1)[start:start + length]

    def to(self, device, non_blocking: bool = False) -> "PackedRows":
        return PackedRows(*(tensor.to(device, non_blocking=non_blocking) for tensor in (
            self.tokens, self.position_ids, self.segment_ids, self.starts, self.lengths)))

    def attention_mask(self) -> torch.Tensor:
        """[R, 1, L, L] bool, True = masked: causal within each sequence; padding sees only itself."""
        columns = torch.arange(self.row_length, device=self.tokens.device)
        causal = columns[None, :] <= columns[:, None]  # key <= query
        segments = self.segment_ids
        attend = causal & (segments[:, :, None] == segments[:, None, :]) & (segments >= 0)[:, :, None]
        attend |= torch.eye(self.row_length, dtype=torch.bool, device=self.tokens.device)  # no empty softmax row
        return ~attend[:, None]

    def packed_seq_params(self):
        """megatron's THD parameters for the rows flattened to one sequence (tail padding a sequence too)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        segments = self.segment_ids.reshape(-1)
        flat = torch.arange(1, len(segments), device=segments.device)
        starts = (flat % self.row_length == 0) | (segments[1:] != segments[:-1])  # a row or a sequence begins
        cu_seqlens = torch.cat([flat.new_zeros(1), flat[starts], flat.new_full((1,), len(segments))]).to(torch.int32)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                               max_seqlen_q=longest, max_seqlen_kv=longest)


def pack_rows(sequences: Sequence[torch.Tensor], row_length: int, pad_id: int,
              rows: Optional[list[list[int]]] = None) -> PackedRows:
    """Lay 1-D token tensors end to end in rows of `row_length` (rows: the plan, default `first_fit_rows`)."""
    lengths = [len(sequence) for sequence in sequences]
    rows = first_fit_rows(lengths, row_length) if rows is None else rows
    tokens = torch.full((len(rows), row_length), pad_id, dtype=torch.long)
    segment_ids = torch.full((len(rows), row_length), -1, dtype=torch.long)
    position_ids = torch.empty((len(rows), row_length), dtype=torch.long)
    starts = torch.zeros(len(sequences), dtype=torch.long)
    for row, members in enumerate(rows):
        column = 0
        for segment, index in enumerate(members):
            length = lengths[index]
            tokens[row, column:column + length] = torch.as_tensor(sequences[index], dtype=torch.long)
            segment_ids[row, column:column + length] = segment
            position_ids[row, column:column + length] = torch.arange(length)
            starts[index] = row * row_length + column
            column += length
        position_ids[row, column:] = torch.arange(row_length - column)
    return PackedRows(tokens, position_ids, segment_ids, starts, torch.tensor(lengths, dtype=torch.long))


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


def response_window(output: torch.Tensor, packed: PackedRows, prompt_lengths: torch.Tensor,
                    response_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's response columns as padded rows with a one-token prompt: (output [N, W + 1, ...],
    tokens [N, W + 1]). Column j of a row is the sequence's column prompt_length - 1 + j (clamped to
    the sequence), so `response_logprobs(output, tokens, ones, ...)` and `response_columns(ones, ...)`
    read exactly what they would read from the sequence's padded row."""
    steps = torch.arange(response_width + 1, device=output.device)
    starts, lengths = packed.starts.to(output.device), packed.lengths.to(output.device)
    columns = (prompt_lengths.to(output.device).unsqueeze(1) - 1 + steps).clamp(max=(lengths - 1).unsqueeze(1))
    flat = (starts.unsqueeze(1) + columns.clamp(min=0)).reshape(-1)  # [N * (W + 1)]
    rows = output.reshape(-1, *output.shape[2:]).index_select(0, flat)
    tokens = packed.tokens.to(output.device).reshape(-1).index_select(0, flat)
    return rows.reshape(len(starts), response_width + 1, *output.shape[2:]), tokens.reshape(len(starts), -1)


def token_scores_at(output: torch.Tensor, packed: PackedRows, columns: torch.Tensor) -> torch.Tensor:
    """output [R, L, ...] at each sequence's own column `columns` [N] -> [N, ...]."""
    flat = packed.starts.to(output.device) + columns.to(output.device)
    return output.reshape(-1, *output.shape[2:]).index_select(0, flat)


# ----------------------------------------------------------------------------- rotary positions
def rotary_embedding_at(rotary, position_ids: torch.Tensor) -> torch.Tensor:
    """megatron's rotary embedding [S, B, 1, dim] at each row's own positions ([B, S]), computed as
    `RotaryEmbedding.get_emb` does for columns (the same products, so equal positions give equal bits)."""
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
    """Whether batches are packed at this layout: asked for, and one pipeline stage (a pipeline
    schedule sends activations of one fixed [rows, length] shape between stages)."""
    from megatron.core import parallel_state as ps

    return packing is not None and packing.enabled and ps.get_pipeline_model_parallel_world_size() == 1


def plan_micro_batches(lengths: Sequence[int], row_length: int, rows_per_micro_batch: int) -> list[list[list[int]]]:
    """Sequence indices per row per micro batch: `first_fit_rows`, then `rows_per_micro_batch` rows at a time."""
    rows = first_fit_rows(lengths, row_length)
    return [rows[start:start + rows_per_micro_batch] for start in range(0, len(rows), rows_per_micro_batch)]


def pack_micro_batch(sequences: Sequence[torch.Tensor], rows: list[list[int]], row_length: int,
                     pad_id: int) -> tuple[list[int], PackedRows]:
    """(members, packed): the sequences named in `rows` (indices into `sequences`) as packed rows,
    their order in `packed` being `members`."""
    members = [index for row in rows for index in row]
    local, position = [], 0
    for row in rows:
        local.append(list(range(position, position + len(row))))
        position += len(row)
    return members, pack_rows([sequences[index] for index in members], row_length, pad_id, rows=local)


def pack_padded(tokens: torch.Tensor, lengths: torch.Tensor, row_length: Optional[int], pad_id: int) -> PackedRows:
    """Right-padded rows tokens [B, S] with real lengths [B], packed into rows of row_length (default S),
    on the tokens' device."""
    sequences = [row[:length] for row, length in zip(tokens.cpu(), lengths.tolist())]
    return pack_rows(sequences, row_length or tokens.shape[1], pad_id).to(tokens.device)


def packed_rows_of(batch: dict, lengths: torch.Tensor, packing: Optional[PackingSection],
                   pad_id: int) -> Optional[PackedRows]:
    """A collated micro batch's sequences (lengths [B]) as packed rows, built once and kept in
    batch["packed"] (its forward and its loss read the same rows); None where `packs_here` says no."""
    if not packs_here(packing):
        return None
    if "packed" not in batch:
        batch["packed"] = pack_padded(batch["tokens"], lengths, packing.row_length, pad_id)
    return batch["packed"]


def forward_batch(model: torch.nn.Module, batch: dict, packed: Optional[PackedRows]) -> torch.Tensor:
    """A collated micro batch through the chunk: packed rows, or its padded tokens and position ids."""
    if packed is not None:
        return packed_forward(model, packed)
    return model(batch["tokens"], batch["position_ids"], None)
