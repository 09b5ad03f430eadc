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

import abc
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from aligner.models.deferred_output import HiddenStates, forward_deferred
from aligner.models.forward import run_microbatches


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


def _consecutive_pieces(positions: torch.Tensor, chunk_tokens: int) -> list[tuple[int, int]]:
    """[(first, count)]: `positions` cut into runs of consecutive positions (a response's columns, a
    label span) of at most chunk_tokens, so each piece is a slice of the logits, not a gather (slow on CPU)."""
    positions = positions.tolist()
    pieces: list[tuple[int, int]] = []
    for index, position in enumerate(positions):
        if pieces and index and position == positions[index - 1] + 1 and pieces[-1][1] < chunk_tokens:
            pieces[-1] = (pieces[-1][0], pieces[-1][1] + 1)
        else:
            pieces.append((index, 1))
    return pieces


def _scaled(piece: torch.Tensor, first_padded: int, temperature: float) -> torch.Tensor:
    """A [count, vocab_shard] fp32 piece of logits, in place: the padded vocabulary at -inf, / temperature."""
    piece[:, first_padded:] = float("-inf")
    if temperature != 1.0:
        piece.div_(temperature)
    return piece


def _piece_buffer(pieces, shard: int, device) -> torch.Tensor:
    """An fp32 [longest piece, shard] buffer that every piece of a pass reuses (no fresh pages per piece)."""
    return torch.empty(max((length for _, length in pieces), default=0), shard, dtype=torch.float32, device=device)


class _Pieces(abc.ABC):
    """Pieces of [n, vocab_shard] logits as the passes read them: x / T minus the row's max over the real
    vocabulary, the padded vocabulary at -inf, in one fp32 buffer that every piece reuses.

    may_hold_inf: whether a piece may hold -inf (padded vocabulary, or logits handed in from outside), whose
    zero softmax weight the entropy's terms must mask (0 * -inf is nan); the output layer's own logits are
    finite, and without padding the masking passes are skipped."""

    def __init__(self, buffer: torch.Tensor, first_padded: int, temperature: float, from_layer: bool):
        self.buffer, self.first_padded, self.temperature = buffer, first_padded, temperature
        self.may_hold_inf = first_padded < buffer.shape[1] or not from_layer

    @abc.abstractmethod
    def scaled(self, index: int, length: int) -> torch.Tensor:
        """x / T of positions index..index+length in the buffer, padded vocabulary at -inf."""

    def row_max(self, index: int, length: int) -> torch.Tensor:
        """[length] max of x / T over the real vocabulary."""
        return self.scaled(index, length).amax(-1)

    def shifted(self, index: int, length: int, row_max: torch.Tensor, known: bool) -> torch.Tensor:
        """x / T - row_max in the buffer; row_max [length] is filled in first unless known."""
        piece = self.scaled(index, length)
        if not known:
            row_max.copy_(piece.amax(-1))
        return piece.sub_(row_max.unsqueeze(1))


class _LogitPieces(_Pieces):
    """Pieces of given logits [tokens, vocab_shard] at positions (each piece a run of consecutive ones)."""

    def __init__(self, flat_logits, positions, buffer, first_padded, temperature, from_layer):
        super().__init__(buffer, first_padded, temperature, from_layer)
        self.flat_logits, self.positions = flat_logits, positions

    def _source(self, index: int, length: int) -> torch.Tensor:
        first = int(self.positions[index])
        return self.flat_logits[first:first + length]

    def scaled(self, index, length):
        piece = self.buffer[:length]
        piece.copy_(self._source(index, length))
        return _scaled(piece, self.first_padded, self.temperature)

    def row_max(self, index, length):
        source = self._source(index, length)
        if source.dtype != torch.float32 or self.first_padded == 0:  # a shard of padding only: -inf, as scaled
            return super().row_max(index, length)
        # max(x) / T is max(x / T) exactly (rounding is monotone): no copy of the piece for it
        row_max = source[:, :self.first_padded].amax(-1)
        return row_max if self.temperature == 1.0 else row_max.div_(self.temperature)

    def shifted(self, index, length, row_max, known):
        source = self._source(index, length)
        if source.dtype != torch.float32:
            return super().shifted(index, length, row_max, known)
        if not known:
            row_max.copy_(self.row_max(index, length))
        # The copy into the buffer and the subtraction in one pass (the same values as copy, scale, subtract)
        piece = self.buffer[:length]
        if self.temperature == 1.0:
            torch.sub(source, row_max.unsqueeze(1), out=piece)
        else:
            torch.div(source, self.temperature, out=piece).sub_(row_max.unsqueeze(1))
        piece[:, self.first_padded:] = float("-inf")
        return piece


class _ProductPieces(_Pieces):
    """Pieces of the output layer's logits of hidden rows [n, h] (rows @ weight [vocab_shard, h]^T, in the
    weight's dtype, as the layer computes them), each computed into the buffer when read."""

    def __init__(self, rows, weight, buffer, first_padded, temperature):
        super().__init__(buffer, first_padded, temperature, from_layer=True)
        self.rows, self.weight = rows, weight

    def scaled(self, index, length):
        piece = self.buffer[:length]
        if self.weight.dtype == torch.float32:
            torch.mm(self.rows[index:index + length], self.weight.t(), out=piece)
        else:
            piece.copy_(torch.mm(self.rows[index:index + length], self.weight.t()))
        return _scaled(piece, self.first_padded, self.temperature)


class _PieceStatistics(NamedTuple):
    """What backward needs per position (besides the logits): all relative to the row's max."""

    row_max: torch.Tensor
    sum_exp: torch.Tensor  # sum exp(x - max)
    expected_logit: torch.Tensor  # E[x] - max under softmax(x)


def _logprobs_and_entropy(logits: _Pieces, pieces, count, targets, vocab_start, shard, group, with_entropy, device):
    """Forward of the selected-positions pass: (logprobs, entropy, _PieceStatistics) of `count` positions.

    logits: the pieces of positions index..index+length (`_Pieces`: a reused buffer, consumed before the
    next piece is read). The same numbers as megatron's
    vocab_parallel_cross_entropy (max-shifted log-sum-exp, all-reduced over the tensor-parallel group;
    the target logit from the shard that holds it), with three floats kept per position.
    """
    row_max = torch.empty(count, dtype=torch.float32, device=device)
    sum_exp = torch.empty_like(row_max)  # sum exp(x - max)
    target_logit = torch.zeros_like(row_max)  # x[target] - max
    expected_logit = torch.zeros_like(row_max)  # E[x - max]
    local_targets = targets - vocab_start
    on_shard = (local_targets >= 0) & (local_targets < shard)
    weights_buffer = _piece_buffer(pieces, shard, device) if with_entropy else None
    if group is not None:
        # The maximum over the whole vocabulary first: every shard's sums are taken relative to it.
        for index, length in pieces:
            row_max[index:index + length] = logits.row_max(index, length)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    for index, length in pieces:
        part = slice(index, index + length)
        piece = logits.shifted(index, length, row_max[part], known=group is not None)  # x - max
        piece_targets = local_targets[part].clamp(0, shard - 1).unsqueeze(1)
        target_logit[part] = torch.where(on_shard[part], piece.gather(1, piece_targets).squeeze(1), 0.0)
        if with_entropy:
            weights = torch.exp(piece, out=weights_buffer[:length])
            sum_exp[part] = weights.sum(-1)
            if logits.may_hold_inf:  # 0 stands in for -inf (padded entries), whose weight is 0: no 0 * -inf nan
                piece.masked_fill_(weights == 0, 0.0)
            expected_logit[part] = (weights.mul_(piece)).sum(-1)
        else:
            sum_exp[part] = piece.exp_().sum(-1)
    if group is not None:
        sums = torch.stack([sum_exp, expected_logit, target_logit])
        dist.all_reduce(sums, group=group)
        sum_exp, expected_logit, target_logit = sums.unbind()
    # Everything relative to the max, as megatron's loss log(sum exp(x - max)) - (x[target] - max):
    # adding the max back first would cancel digits.
    expected_logit = expected_logit / sum_exp
    logprobs = target_logit - torch.log(sum_exp)
    entropy = torch.log(sum_exp) - expected_logit
    return logprobs, entropy, _PieceStatistics(row_max, sum_exp, expected_logit), local_targets, on_shard


def _piece_gradients(logits: _Pieces, pieces, statistics: _PieceStatistics, local_targets, on_shard, grad_logprobs,
                     grad_entropy, temperature, shard, device, take) -> None:
    """Backward of the selected-positions pass: each piece's gradient of its logits, handed to
    take(index, length, grad [length, shard] fp32, a reused buffer).

    d logprob / dx = onehot - p and d entropy / dx = -p (x - E[x]) for x = logits / T, each rank
    computing its own shard's part; the piece's softmax is recomputed from the saved sums.
    """
    row_max, sum_exp, expected_logit = statistics
    probs_buffer = None if grad_entropy is None else _piece_buffer(pieces, shard, device)
    for index, length in pieces:
        part = slice(index, index + length)
        shifted = logits.shifted(index, length, row_max[part], known=True)  # x - max
        if grad_entropy is None:  # the softmax in place: x - max is not needed after
            grad = shifted.exp_().div_(sum_exp[part].unsqueeze(1)).mul_(-grad_logprobs[part].unsqueeze(1))
        else:
            probs = torch.exp(shifted, out=probs_buffer[:length]).div_(sum_exp[part].unsqueeze(1))
            # -p (x - E[x]), with 0 for the padded entries (p = 0, x = -inf)
            grad = shifted.sub_(expected_logit[part].unsqueeze(1))
            if logits.may_hold_inf:
                grad.masked_fill_(probs == 0, 0.0)
            grad.mul_(probs).mul_(-grad_entropy[part].unsqueeze(1))
            if grad_logprobs is not None:
                grad.sub_(probs.mul_(grad_logprobs[part].unsqueeze(1)))
        if grad_logprobs is not None:
            hit = on_shard[part].nonzero().squeeze(1)
            grad[hit, local_targets[part][hit]] += grad_logprobs[part][hit]
        if temperature != 1.0:
            grad.div_(temperature)
        take(index, length, grad)


class _SelectedLogprobsAndEntropy(torch.autograd.Function):
    """log softmax(logits / T)[target] and the entropy of softmax(logits / T) at chosen rows of
    [tokens, vocab_shard] logits, piece by piece (`_logprobs_and_entropy`, `_piece_gradients`), without
    full-size copies: forward keeps three floats per position, backward recomputes each piece's softmax
    into the gradient of the logits.
    """

    @staticmethod
    def forward(ctx, flat_logits, positions, targets, vocab_start, first_padded, temperature, chunk_tokens, group,
                with_entropy, from_layer):
        pieces = _consecutive_pieces(positions, chunk_tokens)
        logits = _LogitPieces(flat_logits, positions, _piece_buffer(pieces, flat_logits.shape[-1], flat_logits.device),
                              first_padded, temperature, from_layer)
        logprobs, entropy, statistics, local_targets, on_shard = _logprobs_and_entropy(
            logits, pieces, positions.numel(), targets, vocab_start, flat_logits.shape[-1], group, with_entropy,
            flat_logits.device)
        ctx.save_for_backward(flat_logits, positions, local_targets, on_shard, *statistics)
        ctx.settings = (first_padded, temperature, pieces, from_layer)
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        flat_logits, positions, local_targets, on_shard, *statistics = ctx.saved_tensors
        first_padded, temperature, pieces, from_layer = ctx.settings
        if grad_logprobs is None and grad_entropy is None:
            return (None,) * 10
        # One piece over every row in order (the output layer applied at the read positions only): its
        # gradient is the whole gradient, no zeroed [tokens, vocab] tensor to add it into.
        whole = (flat_logits.dtype == torch.float32 and pieces == [(0, flat_logits.shape[0])]
                 and int(positions[0]) == 0)
        grad_logits = None if whole else torch.zeros_like(flat_logits)
        logits = _LogitPieces(flat_logits, positions, _piece_buffer(pieces, flat_logits.shape[-1], flat_logits.device),
                              first_padded, temperature, from_layer)

        def take(index, length, grad):
            nonlocal grad_logits
            if whole:
                grad_logits = grad
                return
            first = int(positions[index])
            grad_logits[first:first + length] += grad  # a position may repeat (a shared prompt's last token)

        _piece_gradients(logits, pieces, _PieceStatistics(*statistics), local_targets, on_shard, grad_logprobs,
                         grad_entropy, temperature, flat_logits.shape[-1], flat_logits.device, take)
        return grad_logits, None, None, None, None, None, None, None, None, None


class _OutputLayerLogprobsAndEntropy(torch.autograd.Function):
    """`_SelectedLogprobsAndEntropy` of the logits that the output layer would give hidden rows [n, h],
    fused with that layer: each piece's logits are computed from its rows (rows @ weight^T) into a reused
    buffer and dropped, in forward and again in backward, which hands on the rows' and the weight's
    gradients. Neither the [n, vocab_shard] logits nor their gradient is ever held: for the price of one
    more output-layer product (two at TP > 1, where the max pass recomputes the pieces too), the largest
    activation and gradient of training are gone (DPO on SmolLM2 at 8 pairs x 512 tokens: 1-1.5 GB less
    peak memory, benchmarks/README.md).

    Tensor parallel as megatron's ColumnParallelLinear (no sequence parallelism): the rows are every
    rank's, the weight this rank's vocabulary shard, and the rows' gradient is summed over the group.
    """

    @staticmethod
    def forward(ctx, rows, weight, targets, vocab_start, first_padded, temperature, chunk_tokens, group,
                with_entropy):
        count = rows.shape[0]
        pieces = [(index, min(chunk_tokens, count - index)) for index in range(0, count, chunk_tokens)]
        logits = _ProductPieces(rows, weight, _piece_buffer(pieces, weight.shape[0], rows.device), first_padded,
                                temperature)
        logprobs, entropy, statistics, local_targets, on_shard = _logprobs_and_entropy(
            logits, pieces, count, targets, vocab_start, weight.shape[0], group, with_entropy, rows.device)
        ctx.save_for_backward(rows, weight, local_targets, on_shard, *statistics)
        ctx.settings = (first_padded, temperature, pieces, group)
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        rows, weight, local_targets, on_shard, *statistics = ctx.saved_tensors
        first_padded, temperature, pieces, group = ctx.settings
        if grad_logprobs is None and grad_entropy is None:
            return (None,) * 9
        rows_need_grad, weight_needs_grad = ctx.needs_input_grad[:2]  # a frozen output layer (LoRA): no weight grad
        grad_rows = torch.empty_like(rows) if rows_need_grad else None
        # the weight's gradient summed piece by piece in fp32 (one rounding to a half dtype at the end)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight_needs_grad \
            else None
        logits = _ProductPieces(rows, weight, _piece_buffer(pieces, weight.shape[0], rows.device), first_padded,
                                temperature)

        def take(index, length, grad):
            part = slice(index, index + length)
            grad = grad if weight.dtype == torch.float32 else grad.to(weight.dtype)  # as the layer's backward
            if grad_rows is not None:
                torch.mm(grad, weight, out=grad_rows[part])
            if grad_weight is None:
                return
            if weight.dtype == torch.float32:
                grad_weight.addmm_(grad.t(), rows[part])
            else:
                grad_weight.add_(torch.mm(grad.t(), rows[part]))

        _piece_gradients(logits, pieces, _PieceStatistics(*statistics), local_targets, on_shard, grad_logprobs,
                         grad_entropy, temperature, weight.shape[0], rows.device, take)
        if group is not None and grad_rows is not None:  # megatron's copy_to_tensor_model_parallel_region:
            dist.all_reduce(grad_rows, group=group)  # the input's gradient summed over the group
        return (grad_rows, None if grad_weight is None else grad_weight.to(weight.dtype),
                None, None, None, None, None, None, None)


def selected_logprobs_and_entropy(
    logits: torch.Tensor,
    rows: torch.Tensor,
    columns: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    chunk_tokens: Optional[int] = None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy), each [n] float32 and differentiable, at n positions of the logits.

    logits: [batch, seq, vocab_shard], this rank's tensor-parallel shard of the padded vocabulary, or the
    model's `HiddenStates` (the output layer is then applied at these positions only);
    rows, columns: [n] long, the positions (one may repeat: a shared prompt's last token predicts each
    of its responses' first); targets: [n] long, the token whose logprob is taken at each (its logits
    being those of the position). Both are those of
    softmax(logits / temperature) over the real vocabulary (`mask_padded_vocab`). Equal to megatron's
    vocab_parallel_cross_entropy of the masked, scaled logits at those positions, without its
    full-size copies. chunk_tokens: positions per chunk (default `LOGPROB_CHUNK_TOKENS`).
    with_entropy=False skips the entropy's work (it is then meaningless and must not be used).
    Given `HiddenStates` and more positions than one chunk, the output layer's product runs inside the
    pass, piece by piece (`_OutputLayerLogprobsAndEntropy`), where the layer is that product alone
    (`product_operands`): the memory of the [n, vocab] logits and their gradient for one more product
    of the layer (benchmarks/README.md); up to one chunk, the layer runs once on all positions first.
    """
    positions = rows * logits.shape[1] + columns
    chunk_tokens = max(1, int(chunk_tokens or LOGPROB_CHUNK_TOKENS))
    settings = dict(vocab_size=vocab_size, temperature=float(temperature), chunk_tokens=chunk_tokens,
                    with_entropy=with_entropy)
    if isinstance(logits, HiddenStates):  # the output layer on these positions only, in their order
        # More positions than one piece: fused with the layer's product, no [n, vocab] logits held
        operands = logits.product_operands(positions) if len(positions) > chunk_tokens else None
        if operands is not None:
            return _apply(_OutputLayerLogprobsAndEntropy, *operands, targets, shard=operands[1].shape[0], **settings)
        flat_logits = logits.logits_at(positions)
        positions = torch.arange(len(positions), device=flat_logits.device)
        from_layer = True
    else:
        flat_logits = logits.reshape(-1, logits.shape[-1])  # a view: the model's logits are contiguous
        from_layer = False  # may hold -inf (masked outside): the entropy's masking stays on
    return _apply(_SelectedLogprobsAndEntropy, flat_logits, positions, targets, from_layer,
                  shard=flat_logits.shape[-1], **settings)


def _apply(function, first, second, targets, *more, shard, vocab_size, temperature, chunk_tokens, with_entropy):
    """function.apply with this rank's vocabulary shard (its first id, and its first padded column); `more`:
    the function's arguments after with_entropy."""
    from megatron.core import parallel_state as ps

    vocab_start = ps.get_tensor_model_parallel_rank() * shard
    first_padded = min(max(vocab_size - vocab_start, 0), shard)
    return function.apply(first, second, targets, vocab_start, first_padded, temperature, chunk_tokens,
                          _tensor_parallel_group(), with_entropy, *more)


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
            output = forward_deferred(model_chunks[0], lambda model, part: model(tokens[part], positions[part], None),
                                      rows)
            parts.append(logprobs_of(rows, output))
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
                     seq_length=seq, micro_batch_size=rows_per_microbatch, defer_output_layer=True)
    result = torch.cat(captured)[:batch] if captured else torch.empty(batch, width, device=device)
    dist.broadcast(result, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return result
