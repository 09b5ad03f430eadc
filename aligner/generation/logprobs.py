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


# Tokens per chunk of the logprob/entropy pass: bounds its [chunk, vocab_shard] fp32 temporaries
# (1024 x 49152 x 4 B = 200 MB) instead of holding full [tokens, vocab] copies.
LOGPROB_CHUNK_TOKENS = 1024


def _tensor_parallel_group() -> Optional[dist.ProcessGroup]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None


def _scaled_chunk(logits: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, first_padded: int,
                  temperature: float) -> torch.Tensor:
    """[n, vocab_shard] fp32 logits at (rows, columns) / temperature, padded vocabulary at -inf (a new tensor)."""
    chunk = logits[rows, columns].float()
    chunk[:, first_padded:] = float("-inf")
    if temperature != 1.0:
        chunk.div_(temperature)
    return chunk


class _SelectedLogprobsAndEntropy(torch.autograd.Function):
    """log softmax(logits / T)[target] and the entropy of softmax(logits / T) at chosen (row, column)
    positions of [batch, seq, vocab_shard] logits, chunk by chunk.

    The same numbers as megatron's vocab_parallel_cross_entropy (max-shifted log-sum-exp, all-reduced
    over the tensor-parallel group; the target logit from the shard that holds it), but only at the
    positions asked for, and without full-size copies: forward keeps per-position log Z and E[logit],
    backward recomputes each chunk's softmax. d logprob / dx = onehot - p and d entropy / dx =
    -p (x - E[x]) for x = logits / T, each rank computing its own shard's part.
    """

    @staticmethod
    def forward(ctx, logits, rows, columns, targets, vocab_start, first_padded, temperature, chunk_tokens, group,
                with_entropy):
        count = rows.numel()
        shard_max = torch.empty(count, dtype=torch.float32, device=logits.device)
        sum_exp = torch.empty_like(shard_max)  # sum exp(x - max)
        target_logit = torch.zeros_like(shard_max)  # x[target] - max
        expected_logit = torch.zeros_like(shard_max)  # E[x - max]
        shard = logits.shape[-1]
        local_targets = targets - vocab_start
        on_shard = (local_targets >= 0) & (local_targets < shard)
        # Pass 1: the maximum over the whole vocabulary of each position (the shift log Z is taken at).
        for start in range(0, count, chunk_tokens):
            part = slice(start, start + chunk_tokens)
            shard_max[part] = _scaled_chunk(logits, rows[part], columns[part], first_padded, temperature).amax(-1)
        row_max = shard_max
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        # Pass 2: sum exp(x - max), sum exp(x - max) * x and the target logit, this shard's parts.
        for start in range(0, count, chunk_tokens):
            part = slice(start, start + chunk_tokens)
            chunk = _scaled_chunk(logits, rows[part], columns[part], first_padded, temperature)
            chunk_targets = local_targets[part].clamp(0, shard - 1)
            target_logit[part] = torch.where(on_shard[part], chunk.gather(1, chunk_targets.unsqueeze(1)).squeeze(1)
                                             - row_max[part], 0.0)
            chunk.sub_(row_max[part].unsqueeze(1))  # x - max
            weights = torch.exp(chunk)
            sum_exp[part] = weights.sum(-1)
            if with_entropy:
                # 0 stands in for the -inf of padded entries, whose weight is 0 (no 0 * -inf nan).
                expected_logit[part] = (weights * torch.where(weights > 0, chunk, 0.0)).sum(-1)
        if group is not None:
            sums = torch.stack([sum_exp, expected_logit, target_logit])
            dist.all_reduce(sums, group=group)
            sum_exp, expected_logit, target_logit = sums.unbind()
        # Everything relative to the max, as megatron's loss log(sum exp(x - max)) - (x[target] - max):
        # adding the max back first would cancel digits.
        expected_logit = expected_logit / sum_exp
        logprobs = target_logit - torch.log(sum_exp)
        entropy = torch.log(sum_exp) - expected_logit
        ctx.save_for_backward(logits, rows, columns, local_targets, on_shard, row_max, sum_exp, expected_logit)
        ctx.settings = (first_padded, temperature, chunk_tokens)
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, rows, columns, local_targets, on_shard, row_max, sum_exp, expected_logit = ctx.saved_tensors
        first_padded, temperature, chunk_tokens = ctx.settings
        grad_logits = torch.zeros_like(logits)
        for start in range(0, rows.numel(), chunk_tokens):
            part = slice(start, start + chunk_tokens)
            chunk = _scaled_chunk(logits, rows[part], columns[part], first_padded, temperature)
            chunk.sub_(row_max[part].unsqueeze(1))  # x - max
            probs = torch.exp(chunk).div_(sum_exp[part].unsqueeze(1))  # [n, vocab_shard]; 0 on padding
            grad = torch.zeros_like(probs)
            if grad_entropy is not None:
                centered = torch.where(probs > 0, chunk - expected_logit[part].unsqueeze(1), 0.0)
                grad.sub_(probs * centered * grad_entropy[part].unsqueeze(1))
            if grad_logprobs is not None:
                scale = grad_logprobs[part].unsqueeze(1)
                grad.sub_(probs * scale)
                hit = on_shard[part]
                hit_rows = torch.arange(probs.shape[0], device=probs.device)[hit]
                grad[hit_rows, local_targets[part][hit]] += scale.squeeze(1)[hit]
            if temperature != 1.0:
                grad.div_(temperature)
            grad_logits.index_put_((rows[part], columns[part]), grad.to(grad_logits.dtype), accumulate=True)
        return grad_logits, None, None, None, None, None, None, None, None, None


def selected_logprobs_and_entropy(
    logits: torch.Tensor,
    rows: torch.Tensor,
    columns: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy), each [n] float32 and differentiable, at n chosen positions of the logits.

    logits: [batch, seq, vocab_shard], this rank's tensor-parallel shard of the padded vocabulary;
    rows, columns: [n] long, the positions; targets: [n] long, the token whose logprob is taken at
    each (its logits being those of the position). Both are those of softmax(logits / temperature)
    over the real vocabulary (`mask_padded_vocab`). Equal to megatron's vocab_parallel_cross_entropy
    of the masked, scaled logits at those positions, without its full-size copies.
    with_entropy=False skips the entropy's work (it is then meaningless and must not be used).
    """
    from megatron.core import parallel_state as ps

    shard = logits.shape[-1]
    vocab_start = ps.get_tensor_model_parallel_rank() * shard
    first_padded = min(max(vocab_size - vocab_start, 0), shard)
    return _SelectedLogprobsAndEntropy.apply(logits, rows, columns, targets, vocab_start, first_padded,
                                             float(temperature), max(1, int(chunk_tokens)), _tensor_parallel_group(),
                                             with_entropy)


def response_logprobs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    prompt_lengths: torch.Tensor,
    response_lengths: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    response_width: Optional[int] = None,
    entropy_grad: bool = True,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) [batch, response_width] of the response tokens, 0 after each response's end.

    logits and tokens as in `response_logprobs`; the entropy is that of the sampling distribution
    softmax(logits / temperature) at each response token's column. entropy_grad=False: the entropy
    is returned detached (no backward work for it); with_entropy=False: not computed (zeros).
    """
    batch, seq = tokens.shape
    width = int(response_lengths.max()) if response_width is None else response_width
    if width == 0 or seq < 2:
        zeros = logits.new_zeros(batch, width, dtype=torch.float32)
        return zeros, zeros.clone()
    device = tokens.device
    columns = response_columns(prompt_lengths.to(device), width, seq - 2)  # [batch, width]
    inside = response_mask(response_lengths.to(device), width)
    rows = torch.arange(batch, device=device).unsqueeze(1).expand(-1, width)[inside]
    selected_columns = columns[inside]
    logprobs, entropy = selected_logprobs_and_entropy(
        logits, rows, selected_columns, tokens[rows, selected_columns + 1], vocab_size=vocab_size,
        temperature=temperature, with_entropy=with_entropy)
    if not (entropy_grad and with_entropy):
        entropy = entropy.detach()
    zeros = logits.new_zeros(batch, width, dtype=torch.float32)
    return zeros.masked_scatter(inside, logprobs), zeros.masked_scatter(inside, entropy)


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
    gathered); tokens [batch, seq] in the layout above. Only the response columns are computed,
    chunk by chunk (`selected_logprobs_and_entropy`).
    temperature: the sampling temperature (greedy rollouts: 1).
    """
    logprobs, _ = response_logprobs_and_entropy(logits, tokens, prompt_lengths, response_lengths,
                                                vocab_size=vocab_size, temperature=temperature,
                                                response_width=response_width, with_entropy=False)
    return logprobs


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
