"""The model layers of aligner/models/layers.py equal megatron's: the local spec's attention core
(outputs and input gradients, causal without a mask, a packed block-diagonal mask, grouped queries, the
fallback where dropout is on) and the batch-major output layer (a whole model's logits and gradients).
One process (TP=1; tests/distributed/test_sft_parity.py runs them at TP/PP > 1)."""
from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from aligner.models.gpt import GPTConfig, layer_spec, transformer_config
from aligner.models.layers import BatchMajorOutputLayer, FusedDotProductAttention

pytestmark = pytest.mark.usefixtures("single_process")

SEQ, BATCH, HEADS, GROUPS, DIM = 24, 3, 6, 2, 16


def _cores(dropout: float = 0.0):
    cfg = GPTConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_query_groups=GROUPS,
                    vocab_size=64, attention_dropout=dropout)
    config = transformer_config(cfg)
    kwargs = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return DotProductAttention(**kwargs), FusedDotProductAttention(**kwargs)


def _inputs(seed: int):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(SEQ, BATCH, HEADS, DIM, generator=generator, dtype=torch.float64).float()
    key, value = (torch.randn(SEQ, BATCH, GROUPS, DIM, generator=generator, dtype=torch.float64).float()
                  for _ in range(2))
    grad = torch.randn(SEQ, BATCH, HEADS * DIM, generator=generator)
    return query, key, value, grad


def _packed_mask() -> torch.Tensor:
    """[B, 1, S, S] True = masked: row b holds sequences split at column 7 + 5b, each causal within itself."""
    columns = torch.arange(SEQ)
    masks = []
    for row in range(BATCH):
        segment = (columns >= 7 + 5 * row).long()
        attend = (columns[None, :] <= columns[:, None]) & (segment[:, None] == segment[None, :])
        masks.append(~attend)
    return torch.stack(masks)[:, None]


def _run(core, inputs, mask):
    query, key, value, grad = inputs
    leaves = [tensor.clone().requires_grad_() for tensor in (query, key, value)]
    output = core(*leaves, mask)
    output.backward(grad)
    return output.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "packed_mask"])
def test_fused_core_equals_megatron(masked):
    reference, fused = _cores()
    inputs = _inputs(seed=3 if masked else 4)
    mask = _packed_mask() if masked else None
    expected, expected_grads = _run(reference, inputs, mask)
    output, grads = _run(fused, inputs, mask)
    assert output.shape == expected.shape == (SEQ, BATCH, HEADS * DIM)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_core_falls_back_to_megatron_under_dropout():
    """Training with attention dropout draws megatron's dropout mask from its RNG tracker: same numbers."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    reference, fused = _cores(dropout=0.5)
    inputs = _inputs(seed=5)
    outputs = []
    for core in (reference, fused):
        model_parallel_cuda_manual_seed(11)
        core.train()
        outputs.append(_run(core, inputs, None)[0])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)


def test_local_spec_uses_the_fused_core():
    spec = layer_spec(GPTConfig())
    assert spec.submodules.self_attention.submodules.core_attention is FusedDotProductAttention


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_batch_major_output_layer_equals_megatron(tied):
    """A tiny GPT's logits [b, s, vocab] (contiguous) and every parameter's gradient are those of the
    same model with megatron's own output layer."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from aligner.models.gpt import build_gpt_model

    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=96, make_vocab_size_divisible_by=8,
                    max_position_embeddings=32, tie_embeddings=tied)
    model_parallel_cuda_manual_seed(0)
    model = build_gpt_model(cfg, transformer_config(cfg))
    assert type(model.output_layer) is BatchMajorOutputLayer
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 96, (3, 10), generator=generator)
    positions = torch.arange(10).expand(3, 10)
    weights = torch.randn(3, 10, 96, generator=generator)
    results = []
    for layer_class in (BatchMajorOutputLayer, ColumnParallelLinear):
        model.output_layer.__class__ = layer_class
        model.zero_grad()
        logits = model(tokens, positions, None)
        (logits * weights).sum().backward()
        results.append((logits.detach(), logits.is_contiguous(),
                        {name: param.grad.clone() for name, param in model.named_parameters()}))
    (logits, contiguous, grads), (expected, _, expected_grads) = results
    assert contiguous and logits.shape == (3, 10, 96)
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        # fp32 round-off of sums in another order, relative to the tensor's scale (3.8e-6 on gradients up
        # to 24-45 with MKL's products on an Intel Xeon)
        scale = float(expected_grads[name].abs().max())
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-5, atol=1e-6 * max(1.0, scale), msg=name)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_deferred_output_layer_gives_the_logprobs_and_gradients_of_the_full_logits(tied):
    """Inside `deferred_output_layer` the model returns its hidden states and the logprob pass applies the
    output layer at the positions it reads only: the logprobs, entropies and every parameter's gradient
    equal those computed from the full logits (the weights of a tied model included)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from aligner.models.deferred_output import HiddenStates, forward_deferred
    from aligner.models.gpt import build_gpt_model
    from aligner.models.logprobs import selected_logprobs_and_entropy

    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=90, make_vocab_size_divisible_by=8,
                    max_position_embeddings=32, tie_embeddings=tied)
    model_parallel_cuda_manual_seed(0)
    model = build_gpt_model(cfg, transformer_config(cfg))
    generator = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, 90, (3, 12), generator=generator)
    positions = torch.arange(12).expand(3, 12)
    rows = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2])  # response-like runs of columns, and a lone position
    columns = torch.tensor([4, 5, 6, 9, 1, 2, 3, 4])
    targets = tokens[rows, columns + 1]
    weights = torch.randn(2, 8, generator=generator, dtype=torch.float64).float()
    results = []
    for deferred in (False, True):
        model.zero_grad()
        if deferred:
            output = forward_deferred(model, lambda m: m(tokens, positions, None))
            assert isinstance(output, HiddenStates) and output.shape == (3, 12, 32)
        else:
            output = model(tokens, positions, None)
            assert output.shape == (3, 12, 96)  # the padded vocabulary
        logprobs, entropy = selected_logprobs_and_entropy(output, rows, columns, targets, vocab_size=90,
                                                          temperature=0.7, chunk_tokens=3)
        (logprobs * weights[0] + entropy * weights[1]).sum().backward()
        results.append((logprobs.detach(), entropy.detach(),
                        {name: param.grad.clone() for name, param in model.named_parameters()}))
    assert not model.output_layer.deferred  # the block put the layer back
    (logprobs, entropy, grads), (expected, expected_entropy, expected_grads) = results[1], results[0]
    torch.testing.assert_close(logprobs, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, expected_entropy, rtol=1e-6, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    if not tied:  # the output layer's gradient is nonzero on the targets' rows: the check is not vacuous
        assert grads["output_layer.weight"][targets].abs().sum() > 0

