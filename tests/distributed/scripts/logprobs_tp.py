"""The chunked logprob/entropy pass at TP=2 (each rank holds half of a padded vocabulary) against the
full-size path it replaces at the same layout and against float64 over the whole vocabulary.
Rank 0 prints one `RESULT <json>` line of the largest differences."""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

from aligner.models.logprobs import response_logprobs, response_logprobs_and_entropy
from aligner.runtime.distributed import ParallelConfig, initialize, shutdown
from tests.unit.test_chunked_logprobs import PADDED, VOCAB, batch, float64_reference, full_size_reference


def main() -> None:
    from megatron.core import parallel_state as ps

    initialize(ParallelConfig(tensor_model_parallel_size=2))
    rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    shard = slice(rank * PADDED // 2, (rank + 1) * PADDED // 2)  # rank 1 holds the padded entries
    logits, tokens, prompt_lengths, response_lengths = batch()
    width, temperature = 8, 0.7
    weights = torch.randn(2, 3, width, generator=torch.Generator().manual_seed(1))
    result = {}

    def value_and_grad(compute, full_vocabulary=False):
        leaf = (logits if full_vocabulary else logits[..., shard]).clone().requires_grad_()
        logprobs, entropy = compute(leaf)
        ((logprobs * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
        grad = leaf.grad[..., shard] if full_vocabulary else leaf.grad
        return logprobs.detach().double(), entropy.detach().double(), grad.double()

    for chunk_tokens in (2, 1024):
        import aligner.models.logprobs as logprobs_module

        logprobs_module.LOGPROB_CHUNK_TOKENS = chunk_tokens
        chunked = value_and_grad(lambda leaf: response_logprobs_and_entropy(
            leaf, tokens, prompt_lengths, response_lengths, vocab_size=VOCAB, temperature=temperature,
            response_width=width))
        old = value_and_grad(lambda leaf: full_size_reference(leaf, tokens, prompt_lengths, response_lengths,
                                                              temperature, width, group))
        float64 = value_and_grad(lambda leaf: float64_reference(leaf, tokens, prompt_lengths, response_lengths,
                                                                temperature, width), full_vocabulary=True)
        logprobs_only = value_and_grad(lambda leaf: (response_logprobs(
            leaf, tokens, prompt_lengths, response_lengths, vocab_size=VOCAB, temperature=temperature,
            response_width=width), torch.zeros(3, width)))
        old_logprobs_only = value_and_grad(lambda leaf: (full_size_reference(
            leaf, tokens, prompt_lengths, response_lengths, temperature, width, group)[0], torch.zeros(3, width)))
        differences = {
            "logprobs_vs_old": (chunked[0] - old[0]).abs().max(),
            "entropy_vs_old": (chunked[1] - old[1]).abs().max(),
            "logprob_grad_vs_old": (logprobs_only[2] - old_logprobs_only[2]).abs().max(),
            "logprobs_vs_float64": (chunked[0] - float64[0]).abs().max(),
            "entropy_vs_float64": (chunked[1] - float64[1]).abs().max(),
            "grad_vs_float64": (chunked[2] - float64[2]).abs().max(),
        }
        for name, value in differences.items():  # the largest over both ranks
            value = value.float().reshape(1)
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
            result[f"chunk{chunk_tokens}/{name}"] = float(value)
    result.update(fused_with_output_layer(rank, shard, group, temperature))
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    shutdown()


def fused_with_output_layer(rank: int, shard: slice, group, temperature: float) -> dict:
    """The pass fused with the output layer (hidden rows, this rank's weight shard) against float64 over the
    whole vocabulary: logprobs, entropies, the rows' gradient (summed over the ranks) and this rank's
    weight gradient, with pieces smaller than the rows (2) and one piece (1024)."""
    from aligner.models.logprobs import _OutputLayerLogprobsAndEntropy
    from tests.unit.test_chunked_logprobs import output_layer_operands

    rows, weight, targets = output_layer_operands()
    rows64, weight64 = rows.double().requires_grad_(), weight.double().requires_grad_()
    log_softmax = torch.log_softmax((rows64 @ weight64[:VOCAB].t()) / temperature, dim=-1)
    logprobs64 = log_softmax.gather(1, targets.unsqueeze(1)).squeeze(1)
    entropy64 = -(log_softmax.exp() * log_softmax).sum(-1)
    (0.6 * logprobs64.sum() - 0.4 * entropy64.sum()).backward()
    expected = (logprobs64.detach(), entropy64.detach(), rows64.grad, weight64.grad[shard])
    result = {}
    for chunk_tokens in (2, 1024):
        rows_leaf, weight_leaf = rows.clone().requires_grad_(), weight[shard].clone().requires_grad_()
        vocab_start = rank * weight_leaf.shape[0]
        first_padded = min(max(VOCAB - vocab_start, 0), weight_leaf.shape[0])
        logprobs, entropy = _OutputLayerLogprobsAndEntropy.apply(rows_leaf, weight_leaf, targets, vocab_start,
                                                                 first_padded, temperature, chunk_tokens, group, True)
        (0.6 * logprobs.sum() - 0.4 * entropy.sum()).backward()
        got = (logprobs.detach(), entropy.detach(), rows_leaf.grad, weight_leaf.grad)
        for name, value, want in zip(("logprobs", "entropy", "rows_grad", "weight_grad"), got, expected):
            difference = (value.double() - want).abs().max().float().reshape(1)
            dist.all_reduce(difference, op=dist.ReduceOp.MAX)
            result[f"fused_chunk{chunk_tokens}/{name}_vs_float64"] = float(difference)
    return result


if __name__ == "__main__":
    main()
