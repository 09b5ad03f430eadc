"""Packed vs padded batches at a tensor-parallel layout (torchrun, gloo): logprob passes, the RL policy
loss and the DPO loss with their gradients, on a tiny llama model; rank 0 writes the largest differences.

    torchrun --nproc_per_node 2 packing_parallel.py OUTPUT_JSON TP
"""
import json
import sys

import torch
import torch.distributed as dist


def main() -> None:
    from megatron.core import parallel_state as ps

    from aligner.algorithms.dpo import DPOObjective, DPOSection
    from aligner.models import logprobs, packed_logprobs, packing
    from aligner.models.gpt import GPTConfig, build_model_chunks
    from aligner.runtime import distributed, seeds
    from tests.unit.test_packing import _policy_planner, _rollouts

    output, tp = sys.argv[1], int(sys.argv[2])
    parallel = distributed.ParallelConfig(tensor_model_parallel_size=tp)
    distributed.initialize(parallel)
    seeds.set_seed(0)
    vocab = 50
    cfg = GPTConfig.llama(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=vocab,
                          make_vocab_size_divisible_by=8, max_position_embeddings=64)
    model = build_model_chunks(cfg, parallel, torch.float32)[0]
    tokens, prompts, responses = _rollouts()
    differences = {}

    padded = logprobs.sequence_logprobs([model], tokens, prompts, responses, vocab_size=vocab, temperature=0.7,
                                        response_width=12, micro_batch_size=2)
    packed = packed_logprobs.sequence_logprobs([model], tokens, prompts, responses, vocab_size=vocab, temperature=0.7,
                                               packing=packing.PackingSection(), pad_id=0, response_width=12,
                                               micro_batch_size=2)
    differences["logprobs"] = float((padded - packed).abs().max())

    def gradients():
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    def largest(first, second):
        return max(float((first[name] - second[name]).abs().max()) for name in first)

    # DPO: rows 2i, 2i + 1 are a pair; reference sums fixed numbers.
    model.train()
    batch_sequences = {"tokens": tokens[:4], "prompt_lengths": prompts[:4], "response_lengths": responses[:4],
                       "position_ids": torch.arange(24).repeat(4, 1), "reference_logprobs": -torch.arange(4.0) - 5}
    dpo = {}
    for name, section in (("padded", None), ("packed", packing.PackingSection())):
        objective = DPOObjective(DPOSection(beta=0.5, sft_loss_weight=0.3), vocab, section, 0)
        batch = dict(batch_sequences)
        model.zero_grad(set_to_none=True)
        loss, _, _ = objective.loss(batch, objective.forward(model, batch))
        loss.backward()
        dpo[name] = (float(loss), gradients())
    differences["dpo_loss"] = abs(dpo["padded"][0] - dpo["packed"][0])
    differences["dpo_gradients"] = largest(dpo["padded"][1], dpo["packed"][1])

    # RL policy loss with an entropy bonus (vocab-parallel entropy).
    from aligner.models.logprobs import response_mask
    from aligner.training.microbatch_plan import PolicyTargets, SequenceRows

    generator = torch.Generator().manual_seed(3)
    mask = response_mask(responses, 12)
    rows = SequenceRows(tokens=tokens, prompt_lengths=prompts, response_lengths=responses, mask=mask)
    targets = PolicyTargets(old_logprobs=torch.where(mask, -torch.rand(5, 12, generator=generator) * 3, 0),
                            advantages=torch.randn(5, 12, generator=generator) * mask)
    policy = {}
    for enabled in (False, True):
        planner, objective = _policy_planner([f"packing.enabled={str(enabled).lower()}"],
                                             group=ps.get_data_parallel_group())
        microbatches = planner.scale_losses(planner.policy_microbatches(rows, targets, torch.arange(5)))
        model.zero_grad(set_to_none=True)
        total = 0.0
        for microbatch in microbatches:
            loss, _, _ = objective.loss(microbatch, objective.forward(model, microbatch))
            (loss / len(microbatches)).backward()
            total += float(loss) / len(microbatches)
        policy[enabled] = (total, gradients())
    differences["policy_loss"] = abs(policy[False][0] - policy[True][0])
    differences["policy_gradients"] = largest(policy[False][1], policy[True][1])

    if dist.get_rank() == 0:
        with open(output, "w") as out:
            json.dump(differences, out)
    distributed.shutdown()


if __name__ == "__main__":
    main()
