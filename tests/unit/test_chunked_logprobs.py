"""The chunked logprob/entropy pass against the full-size path it replaces (megatron's
vocab_parallel_cross_entropy over every column, entropy over gathered response logits): values and
gradients, with padded vocabulary, a temperature and chunks smaller than the batch."""
from __future__ import annotations

import pytest
import torch

from aligner.models.gpt import mask_padded_vocab
from aligner.models.logprobs import (
    response_columns,
    response_logprobs,
    response_logprobs_and_entropy,
    response_mask,
    selected_logprobs_and_entropy,
)

pytestmark = pytest.mark.usefixtures("single_process")

VOCAB, PADDED = 50, 64


class _SumOverGroup(torch.autograd.Function):
    """All-reduce sum whose backward is the identity (each shard's sums feed every rank's entropy)."""

    @staticmethod
    def forward(ctx, tensor, group):
        tensor = tensor.clone()
        torch.distributed.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def full_size_entropy(logits, mask, group=None):
    """The replaced entropy, log Z + max - E[logit], over full-size [batch, T, vocab_shard] logits
    (already masked and scaled), its [batch, T] sums all-reduced over the tensor-parallel group."""
    row_max = logits.detach().amax(dim=-1)
    if group is not None:
        torch.distributed.all_reduce(row_max, op=torch.distributed.ReduceOp.MAX, group=group)
    weights = torch.exp(logits - row_max.unsqueeze(-1))
    sums = torch.stack([weights.sum(-1), (weights * torch.where(weights > 0, logits, 0.0)).sum(-1)])
    if group is not None:
        sums = _SumOverGroup.apply(sums, group)
    sum_exp, sum_exp_logit = sums.unbind()
    return torch.where(mask, torch.log(sum_exp) + row_max - sum_exp_logit / sum_exp, 0.0)


def full_size_reference(logits, tokens, prompt_lengths, response_lengths, temperature, width, group=None):
    """The replaced path: full-size masked, scaled logits; cross entropy at every column; gather.
    logits: this rank's vocabulary shard; group: the tensor-parallel group (None: TP=1)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = mask_padded_vocab(logits.float(), VOCAB) / temperature
    every_column = -vocab_parallel_cross_entropy(scaled[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    columns = response_columns(prompt_lengths, width, tokens.shape[1] - 2)
    inside = response_mask(response_lengths, width)
    logprobs = torch.where(inside, every_column.gather(1, columns), 0.0)
    response_logits = scaled.gather(1, columns.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    entropy = full_size_entropy(response_logits, inside, group=group)
    return logprobs, entropy


def float64_reference(logits, tokens, prompt_lengths, response_lengths, temperature, width):
    """log_softmax over the real vocabulary in float64 at the response columns."""
    columns = response_columns(prompt_lengths, width, tokens.shape[1] - 2)
    inside = response_mask(response_lengths, width)
    scaled = logits[..., :VOCAB].double().gather(1, columns.unsqueeze(-1).expand(-1, -1, VOCAB)) / temperature
    log_softmax = torch.log_softmax(scaled, dim=-1)
    targets = tokens.gather(1, columns + 1)
    logprobs = torch.where(inside, log_softmax.gather(2, targets.unsqueeze(-1)).squeeze(-1), 0.0)
    return logprobs, torch.where(inside, -(log_softmax.exp() * log_softmax).sum(-1), 0.0)


def batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 9, PADDED, generator=generator) * 4
    tokens = torch.randint(0, VOCAB, (3, 9), generator=generator)
    return logits, tokens, torch.tensor([2, 4, 1]), torch.tensor([5, 3, 7])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_tokens", [1, 4, 1024])
def test_logprobs_entropy_and_gradients_equal_the_full_size_path(temperature, chunk_tokens, monkeypatch):
    import aligner.models.logprobs as logprobs_module

    monkeypatch.setattr(logprobs_module, "LOGPROB_CHUNK_TOKENS", chunk_tokens)
    logits, tokens, prompt_lengths, response_lengths = batch()
    width = 8  # wider than every response: entries past the end are 0
    weights = torch.randn(2, 3, width, generator=torch.Generator().manual_seed(1))

    def value_and_grad(compute):
        leaf = logits.clone().requires_grad_()
        logprobs, entropy = compute(leaf)
        ((logprobs * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
        return logprobs.detach(), entropy.detach(), leaf.grad

    expected = value_and_grad(lambda leaf: full_size_reference(leaf, tokens, prompt_lengths, response_lengths,
                                                               temperature, width))
    chunked = value_and_grad(lambda leaf: response_logprobs_and_entropy(
        leaf, tokens, prompt_lengths, response_lengths, vocab_size=VOCAB, temperature=temperature,
        response_width=width))
    torch.testing.assert_close(chunked[0], expected[0], rtol=1e-6, atol=1e-6)
    # The replaced entropy, log Z + max - E[logit], loses ~2e-6 to cancellation (logits ~12), and its
    # gradient ~5e-6; the chunked one takes E[logit - max]: entropy and the gradient of the mixed
    # objective are held to float64 (1e-6), the entropy to the old path within its own error.
    torch.testing.assert_close(chunked[1], expected[1], rtol=0, atol=4e-6)
    float64 = value_and_grad(lambda leaf: float64_reference(leaf, tokens, prompt_lengths, response_lengths,
                                                            temperature, width))
    for name, want, got in zip(("logprobs", "entropy", "gradient"), float64, chunked):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=1e-6, msg=name)
    assert chunked[0][0, 5:].eq(0).all() and chunked[1][1, 3:].eq(0).all()
    assert chunked[2][..., VOCAB:].eq(0).all()  # padded vocabulary gets no gradient
    # logprobs alone (DPO, SFT, reference passes): the same numbers and gradient.
    logprobs_only = value_and_grad(lambda leaf: (response_logprobs(
        leaf, tokens, prompt_lengths, response_lengths, vocab_size=VOCAB, temperature=temperature,
        response_width=width), torch.zeros(3, width)))
    torch.testing.assert_close(logprobs_only[0], expected[0], rtol=1e-6, atol=1e-6)
    expected_logprob_grad = value_and_grad(lambda leaf: (full_size_reference(
        leaf, tokens, prompt_lengths, response_lengths, temperature, width)[0], torch.zeros(3, width)))[2]
    torch.testing.assert_close(logprobs_only[2], expected_logprob_grad, rtol=0, atol=1e-6)


def test_float64_reference_and_detached_entropy():
    logits, tokens, _, _ = batch(2)
    rows, columns = torch.tensor([0, 2, 2, 1]), torch.tensor([3, 0, 7, 5])
    targets = tokens[rows, columns + 1]
    leaf = logits.clone().requires_grad_()
    logprobs, entropy = selected_logprobs_and_entropy(leaf, rows, columns, targets, vocab_size=VOCAB,
                                                      temperature=0.5, chunk_tokens=3)
    log_softmax = torch.log_softmax(logits[rows, columns, :VOCAB].double() / 0.5, dim=-1)
    torch.testing.assert_close(logprobs.double(), log_softmax.gather(1, targets.unsqueeze(1)).squeeze(1),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), -(log_softmax.exp() * log_softmax).sum(-1), rtol=0, atol=1e-5)
    # A detached entropy leaves the logprob gradient alone.
    _, detached = response_logprobs_and_entropy(leaf, tokens, torch.tensor([2, 4, 1]), torch.tensor([5, 3, 7]),
                                                vocab_size=VOCAB, entropy_grad=False)
    assert not detached.requires_grad


def test_a_repeated_position_gets_the_sum_of_its_gradients():
    """Rows that share a prompt read its last position once per response (each with its own target):
    the gradient there is the sum of both reads', as float64 autograd over the full log-softmax gives it."""
    logits, tokens, _, _ = batch(4)
    rows, columns = torch.tensor([1, 1, 1, 0, 1]), torch.tensor([2, 3, 2, 6, 2])  # (1, 2) read three times
    targets = torch.tensor([5, 9, 11, 4, 5])
    leaf = logits.clone().requires_grad_()
    logprobs, entropy = selected_logprobs_and_entropy(leaf, rows, columns, targets, vocab_size=VOCAB,
                                                      temperature=0.7, chunk_tokens=2)
    (logprobs * torch.tensor([0.3, -1.0, 0.5, 2.0, 0.25]) + 0.1 * entropy).sum().backward()
    reference = logits.double().clone().requires_grad_()
    log_softmax = torch.log_softmax(mask_padded_vocab(reference, VOCAB)[rows, columns] / 0.7, dim=-1)
    expected = log_softmax.gather(1, targets.unsqueeze(1)).squeeze(1)
    expected_entropy = -(log_softmax.exp() * log_softmax.masked_fill(log_softmax.isinf(), 0)).sum(-1)
    (expected * torch.tensor([0.3, -1.0, 0.5, 2.0, 0.25], dtype=torch.float64)
     + 0.1 * expected_entropy).sum().backward()
    torch.testing.assert_close(logprobs.double(), expected.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(leaf.grad.double(), reference.grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk_tokens", [2, 1024])
def test_logits_without_padded_vocabulary_from_the_layer_and_from_outside(chunk_tokens):
    """Without padded vocabulary the output layer's own logits skip the entropy's -inf masking, and one piece
    over every row hands its gradient on whole; logits from outside keep the masking, so -inf entries in them
    (masked upstream) still give finite entropies. Each against float64 autograd over the full log-softmax."""
    from aligner.models.logprobs import _apply, _SelectedLogprobsAndEntropy

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, VOCAB, generator=generator) * 4
    targets = torch.randint(0, VOCAB, (6,), generator=generator)
    weights = torch.tensor([0.3, -1.0, 0.5, 2.0, 0.25, 1.5])
    for from_layer, masked in ((True, False), (False, True)):
        given = logits.clone()
        if masked:
            given[1, 7] = given[4, 0] = float("-inf")
        leaf = given.clone().requires_grad_()
        logprobs, entropy = _apply(_SelectedLogprobsAndEntropy, leaf, torch.arange(6), targets, from_layer,
                                   shard=VOCAB, vocab_size=VOCAB, temperature=0.7, chunk_tokens=chunk_tokens,
                                   with_entropy=True)
        ((logprobs * weights).sum() + 0.1 * entropy.sum()).backward()
        reference = given.double().requires_grad_()
        log_softmax = torch.log_softmax(reference / 0.7, dim=-1)
        expected = log_softmax.gather(1, targets.unsqueeze(1)).squeeze(1)
        expected_entropy = -(log_softmax.exp() * log_softmax.masked_fill(log_softmax.isinf(), 0)).sum(-1)
        ((expected * weights.double()).sum() + 0.1 * expected_entropy.sum()).backward()
        assert torch.isfinite(entropy).all() and torch.isfinite(leaf.grad).all()
        torch.testing.assert_close(logprobs.double(), expected.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(entropy.double(), expected_entropy.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(leaf.grad.double(), reference.grad, rtol=0, atol=1e-5)


def test_a_row_maximum_read_from_the_logits_equals_the_scaled_pieces():
    """The maximum of x / T is read from the logits themselves (no copy) where they are fp32: equal to the
    maximum of the scaled piece, padded columns left out; a shard of padding only gives -inf."""
    from aligner.models.logprobs import _LogitPieces

    logits = torch.randn(5, 16) * 3
    for first_padded, temperature in ((16, 1.0), (11, 0.7), (0, 1.0)):
        pieces = _LogitPieces(logits, torch.arange(5), torch.empty(5, 16), first_padded, temperature, True)
        expected = pieces.scaled(1, 3).amax(-1)
        assert torch.equal(pieces.row_max(1, 3), expected)
        assert (first_padded == 0) == bool(expected.eq(float("-inf")).all())


def test_no_positions_give_a_zero_loss_and_gradient():
    from aligner.algorithms.sft import response_token_loss

    logits, tokens, _, _ = batch()
    leaf = logits.clone().requires_grad_()
    loss_sum, count = response_token_loss(leaf, tokens, torch.zeros(3, 9), VOCAB)
    loss_sum.backward()
    assert float(loss_sum) == 0 and int(count) == 0 and leaf.grad.eq(0).all()


def output_layer_operands(dtype=torch.float32, seed=3, count=11, hidden=16):
    """Hidden rows [count, hidden], an output weight over the padded vocabulary, targets in the real one."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(count, hidden, generator=generator).to(dtype)
    weight = (torch.randn(PADDED, hidden, generator=generator) * 0.8).to(dtype)
    return rows, weight, torch.randint(0, VOCAB, (count,), generator=generator)


def fused_and_unfused(rows, weight, targets, temperature, chunk_tokens, with_entropy=True, grads=(0.6, -0.4)):
    """(logprobs, entropy, rows' gradient, weight's gradient) of the fused pass and of the pass over the
    layer's logits (rows @ weight^T, as the layer computes them), for the objective sum(a lp + b entropy)."""
    from aligner.models.logprobs import _OutputLayerLogprobsAndEntropy, _SelectedLogprobsAndEntropy

    results = []
    for fused in (True, False):
        rows_leaf, weight_leaf = rows.clone().requires_grad_(), weight.clone().requires_grad_()
        settings = (targets, 0, VOCAB, temperature, chunk_tokens, None, with_entropy)
        if fused:
            logprobs, entropy = _OutputLayerLogprobsAndEntropy.apply(rows_leaf, weight_leaf, *settings)
        else:
            logits = rows_leaf @ weight_leaf.t()
            logprobs, entropy = _SelectedLogprobsAndEntropy.apply(logits, torch.arange(len(rows)), *settings, True)
        objective = grads[0] * logprobs.sum() + (grads[1] * entropy.sum() if with_entropy else 0.0)
        objective.backward()
        results.append((logprobs.detach(), entropy.detach(), rows_leaf.grad, weight_leaf.grad))
    return results


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_tokens", [1, 4, 1024])
def test_the_pass_fused_with_the_output_layer_equals_the_pass_over_its_logits(temperature, chunk_tokens):
    """Given hidden rows, the pass computes each piece's logits itself (never the [n, vocab] logits nor their
    gradient): the same logprobs and entropies, and the rows' and weight's gradients of the unfused
    layer + pass, in fp32; both against float64 over the real vocabulary."""
    rows, weight, targets = output_layer_operands()
    fused, unfused = fused_and_unfused(rows, weight, targets, temperature, chunk_tokens)
    for name, got, want in zip(("logprobs", "entropy", "rows' gradient", "weight's gradient"), fused, unfused):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
    assert fused[3][VOCAB:].eq(0).all() and fused[3][:VOCAB].abs().sum() > 0  # padded vocabulary: no gradient
    rows64, weight64 = rows.double().requires_grad_(), weight.double().requires_grad_()
    log_softmax = torch.log_softmax((rows64 @ weight64[:VOCAB].t()) / temperature, dim=-1)
    logprobs = log_softmax.gather(1, targets.unsqueeze(1)).squeeze(1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    (0.6 * logprobs.sum() - 0.4 * entropy.sum()).backward()
    for name, got, want in zip(("logprobs", "entropy", "rows' gradient", "weight's gradient"), fused,
                               (logprobs, entropy, rows64.grad, weight64.grad)):
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5, msg=name)


def test_the_fused_pass_with_logprobs_only_and_in_bf16():
    rows, weight, targets = output_layer_operands()
    fused, unfused = fused_and_unfused(rows, weight, targets, 1.0, 4, with_entropy=False)
    for got, want in zip((fused[0], *fused[2:]), (unfused[0], *unfused[2:])):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # bf16 weights: the pieces' products run in bf16 as the layer's do; the gradients come back in bf16
    rows, weight, targets = output_layer_operands(torch.bfloat16)
    fused, unfused = fused_and_unfused(rows, weight, targets, 1.0, 4)
    assert fused[2].dtype == fused[3].dtype == torch.bfloat16
    torch.testing.assert_close(fused[0], unfused[0], rtol=0, atol=1e-5)  # the same bf16 logits, fp32 sums
    for got, want in zip(fused[2:], unfused[2:]):  # one bf16 rounding apart (the weight's: summed in fp32 first)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_a_frozen_output_weight_gets_no_gradient_and_the_rows_theirs():
    """A frozen output layer (LoRA trains adapters elsewhere): no weight gradient is computed, the rows' is the same."""
    from aligner.models.logprobs import _OutputLayerLogprobsAndEntropy

    rows, weight, targets = output_layer_operands()
    (_, _, expected_rows_grad, _), _ = fused_and_unfused(rows, weight, targets, 1.0, 4)
    rows_leaf = rows.clone().requires_grad_()
    logprobs, entropy = _OutputLayerLogprobsAndEntropy.apply(rows_leaf, weight, targets, 0, VOCAB, 1.0, 4, None, True)
    (0.6 * logprobs.sum() - 0.4 * entropy.sum()).backward()
    assert weight.grad is None
    torch.testing.assert_close(rows_leaf.grad, expected_rows_grad, rtol=0, atol=0)


def test_no_rows_give_empty_results_and_no_gradient():
    from aligner.models.logprobs import _OutputLayerLogprobsAndEntropy

    rows, weight, _ = output_layer_operands(count=0)
    rows.requires_grad_(), weight.requires_grad_()
    logprobs, entropy = _OutputLayerLogprobsAndEntropy.apply(rows, weight, torch.zeros(0, dtype=torch.long), 0,
                                                             VOCAB, 1.0, 4, None, True)
    assert logprobs.shape == entropy.shape == (0,)
    (logprobs.sum() + entropy.sum()).backward()
    assert weight.grad is None or weight.grad.eq(0).all()
