"""The chunked logprob/entropy pass against the full-size path it replaces (megatron's
vocab_parallel_cross_entropy over every column, entropy over gathered response logits): values and
gradients, with padded vocabulary, a temperature and chunks smaller than the batch."""
from __future__ import annotations

import pytest
import torch

from aligner.generation.logprobs import (
    response_columns,
    response_logprobs,
    response_logprobs_and_entropy,
    response_mask,
    selected_logprobs_and_entropy,
)
from aligner.models.gpt import mask_padded_vocab

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
    import aligner.generation.logprobs as logprobs_module

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


def test_no_positions_give_a_zero_loss_and_gradient():
    from aligner.algorithms.sft import response_token_loss

    logits, tokens, _, _ = batch()
    leaf = logits.clone().requires_grad_()
    loss_sum, count = response_token_loss(leaf, tokens, torch.zeros(3, 9), VOCAB)
    loss_sum.backward()
    assert float(loss_sum) == 0 and int(count) == 0 and leaf.grad.eq(0).all()
