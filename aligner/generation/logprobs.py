"""Per-token logprobs of given responses with a normal (non-cached) megatron forward, any TP/PP.

This is the training side of the numbers the generation engine reports: PPO's actor and reference
passes compute these logprobs for the rollout's query + response, and on the first minibatch
they must equal the engine's (the ratio starts at exactly 1).

Padding convention, shared with `aligner.generation.native.NativeEngine`: every sequence counts
positions from its own first token. Here each row is laid out from column 0, prompt then response
then padding; the causal mask already hides the padding after a sequence, so no attention mask is
needed and position ids are 0..len-1 (this is also the layout of the SFT and reward-model batches).
The engine left-pads prompts to share cache columns, but its position ids skip the padding and
padded keys are masked, so each row computes the same function of the same tokens; the two differ
only by float rounding (tested: < 1e-5 in fp32).

The logprob of response token j of row b is log_softmax(logits / temperature) at that token, the
logits being those at the previous column, over the real vocabulary (padded rows masked); entries
after a response's end are 0. Outputs are [batch, response_width], aligned with
Rollout.response_tokens.

That column, prompt_length - 1 + j (`response_columns`), is also where the critic's value of the
state token j is chosen in sits, and `response_mask` says which of the response_width entries are
real tokens: every caller (logprobs, entropy, values, the critic's loss) takes them from here.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from aligner.models.gpt import mask_padded_vocab


def pack_sequences(prompts: Sequence[Sequence[int]], response_tokens: torch.Tensor, response_lengths: torch.Tensor,
                   pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of prompt + response from column 0, right-padded: (tokens [batch, seq], prompt_lengths [batch]).

    response_tokens [batch, width] and response_lengths [batch] as in a Rollout.
    """
    lengths = [len(p) + int(n) for p, n in zip(prompts, response_lengths.tolist())]
    tokens = torch.full((len(prompts), max(lengths)), pad_id, dtype=torch.long)
    for row, (prompt, length) in enumerate(zip(prompts, response_lengths.tolist())):
        tokens[row, : len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.long)
        tokens[row, len(prompt): len(prompt) + length] = response_tokens[row, :length]
    return tokens, torch.tensor([len(p) for p in prompts])


def response_columns(prompt_lengths: torch.Tensor, response_width: int, last_column: int) -> torch.Tensor:
    """[batch, response_width] long: the column whose logits predict response token j (and whose value is
    the state it is chosen in), prompt_length - 1 + j, clamped to [0, last_column] (entries past a
    response's end are clamped, for the caller to mask out)."""
    steps = torch.arange(response_width, device=prompt_lengths.device)
    return (prompt_lengths.unsqueeze(1) - 1 + steps).clamp(0, last_column)


def response_mask(response_lengths: torch.Tensor, response_width: int) -> torch.Tensor:
    """[batch, response_width] bool: True on each response's own tokens (j < response_length)."""
    steps = torch.arange(response_width, device=response_lengths.device)
    return steps.unsqueeze(0) < response_lengths.unsqueeze(1)


def response_values(token_values: torch.Tensor, prompt_lengths: torch.Tensor, response_width: int) -> torch.Tensor:
    """Values of the response tokens [batch, response_width] from values at every column [batch, seq]:
    response token j's value is the value of the prefix before it (`response_columns`)."""
    columns = response_columns(prompt_lengths.to(token_values.device), response_width, token_values.shape[1] - 1)
    return token_values.gather(1, columns)


def response_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    prompt_lengths: torch.Tensor,
    response_lengths: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    response_width: Optional[int] = None,
) -> torch.Tensor:
    """Logprobs [batch, response_width] of the response tokens from the model's logits (differentiable).

    logits: [batch, seq, vocab_shard], this rank's tensor-parallel shard (the vocabulary is never
    gathered: megatron's vocab-parallel cross entropy); tokens [batch, seq] in the layout above.
    temperature: the sampling temperature (greedy rollouts: 1).
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    batch, seq = tokens.shape
    width = int(response_lengths.max()) if response_width is None else response_width
    if width == 0 or seq < 2:
        return logits.new_zeros(batch, width, dtype=torch.float32)
    scaled = mask_padded_vocab(logits.float(), vocab_size)
    if temperature != 1.0:
        scaled = scaled / temperature
    # Next-token logprobs of every column: column c predicts tokens[:, c + 1].
    token_logprobs = -vocab_parallel_cross_entropy(scaled[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    columns = response_columns(prompt_lengths.to(tokens.device), width, seq - 2)
    inside = response_mask(response_lengths.to(tokens.device), width)
    return torch.where(inside, token_logprobs.gather(1, columns), torch.zeros((), device=tokens.device))


@torch.no_grad()
def sequence_logprobs(
    model_chunks: Sequence[torch.nn.Module],
    tokens: torch.Tensor,
    prompt_lengths: torch.Tensor,
    response_lengths: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    response_width: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
) -> torch.Tensor:
    """Response logprobs [batch, response_width] on every rank, through megatron's schedule (any TP/PP).

    tokens [batch, seq], prompt_lengths and response_lengths [batch]: see `pack_sequences`.
    micro_batch_size: rows per forward (default: all at once).
    """
    from megatron.core import parallel_state as ps

    from aligner.models.forward import run_microbatches

    batch, seq = tokens.shape
    width = int(response_lengths.max()) if response_width is None else response_width
    device = next(model_chunks[0].parameters()).device
    tokens, prompt_lengths, response_lengths = tokens.to(device), prompt_lengths.to(device), response_lengths.to(device)
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
    for chunk in model_chunks:
        chunk.eval()

    def logprobs_of(rows: slice, logits: torch.Tensor) -> torch.Tensor:
        return response_logprobs(logits, tokens[rows], prompt_lengths[rows], response_lengths[rows],
                                 vocab_size=vocab_size, temperature=temperature, response_width=width)

    pipeline = ps.get_pipeline_model_parallel_world_size()
    rows_per_microbatch = min(micro_batch_size or batch, batch)
    if pipeline == 1:
        # One stage: call the model directly (no schedule, so no CPU-bridge scope on this path).
        parts = []
        for start in range(0, batch, rows_per_microbatch):
            rows = slice(start, start + rows_per_microbatch)
            parts.append(logprobs_of(rows, model_chunks[0](tokens[rows], positions[rows], None)))
        return torch.cat(parts)

    # The interleaved (virtual pipeline) schedule needs a multiple of PP micro batches: repeat the
    # last row to fill them, and drop the repeats afterwards.
    num_microbatches = -(-batch // rows_per_microbatch)
    if len(model_chunks) > 1:
        num_microbatches = -(-num_microbatches // pipeline) * pipeline
        rows_per_microbatch = -(-batch // num_microbatches)
    padded = rows_per_microbatch * num_microbatches
    index = torch.arange(padded, device=device).clamp(max=batch - 1)
    microbatches = [{"rows": index[i:i + rows_per_microbatch]} for i in range(0, padded, rows_per_microbatch)]
    captured: list[torch.Tensor] = []

    def forward_fn(model, microbatch):
        return model(tokens[microbatch["rows"]], positions[microbatch["rows"]], None)

    def loss_fn(microbatch, output):
        captured.append(logprobs_of(microbatch["rows"], output))
        return output.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

    run_microbatches(model_chunks, microbatches, forward_fn, loss_fn, forward_only=True,
                     seq_length=seq, micro_batch_size=rows_per_microbatch)
    result = torch.cat(captured)[:batch] if captured else torch.empty(batch, width, device=device)
    dist.broadcast(result, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return result
