"""Token-budget micro batches at DP=2 (torchrun, gloo) against the fixed-size ones of one process: the RL
policy loss and gradients, the RL actor's logprob pass (and its first minibatch's logprobs, which must
be bit-equal to the pass's), and DPO's loss and gradients through the micro-batch loader. Every rank
also computes the single-process reference itself; rank 0 writes the largest differences.

    torchrun --nproc_per_node 2 token_budget_parallel.py OUTPUT_JSON
"""
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    from megatron.core import parallel_state as ps

    from aligner.models import logprobs
    from aligner.models.packed_logprobs import response_logprobs_and_entropy
    from aligner.runtime import distributed, seeds
    from aligner.training.microbatch_plan import PolicyTargets, SequenceRows
    from tests.unit.test_packing import VOCAB, _policy_planner, _tiny_model
    from tests.unit.test_token_budget import _experience, _minibatch_loss_and_gradients

    output = sys.argv[1]
    distributed.initialize(distributed.ParallelConfig())
    seeds.set_seed(0)
    group, rank, ranks = ps.get_data_parallel_group(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    differences = {}

    def reduced_gradients(model, count):
        gradients = {}
        for name, parameter in model.named_parameters():
            grad = parameter.grad.clone()
            dist.all_reduce(grad, group=group)
            gradients[name] = grad / count
        return gradients

    def largest(first, second):
        return max(float((first[name] - second[name]).abs().max()) for name in second)

    # RL policy loss: 8 rollouts per rank; the reference is one process's fixed micro batches of 2.
    model = _tiny_model("llama").train()
    per_rank = 8
    every_row, every_target = _experience(per_rank * ranks, seed=11)
    settings = ["loss.aggregation=sequence_mean_token_mean", f"trainer.global_batch_size={per_rank * ranks}"]
    alone = [dist.new_group([member]) for member in range(ranks)]  # every rank creates every group
    fixed = _policy_planner(["packing.enabled=false", *settings], group=alone[rank])
    reference_loss, reference_grads = _minibatch_loss_and_gradients(
        model, fixed, fixed[0].policy_microbatches(every_row, every_target, torch.arange(per_rank * ranks)))
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    mine = SequenceRows(tokens=every_row.tokens[local], prompt_lengths=every_row.prompt_lengths[local],
                        response_lengths=every_row.response_lengths[local], mask=every_row.mask[local])
    my_targets = PolicyTargets(advantages=every_target.advantages[local], old_logprobs=every_target.old_logprobs[local])
    planner, objective = _policy_planner(["packing.micro_batch_tokens=40", *settings], rank=rank, ranks=ranks,
                                         group=group)
    plan = planner.plan_step(0, mine)  # every rank's rollouts, gathered once
    assert torch.equal(plan.rows.tokens, every_row.tokens)
    assert torch.equal(planner.data_parallel.gather_rows(my_targets.advantages), every_target.advantages)
    microbatches = next(plan.minibatches(my_targets, epochs=1))  # the first minibatch, loss-scaled
    counts = torch.tensor([float(len(microbatches))])
    dist.all_reduce(counts, group=group)
    model.zero_grad(set_to_none=True)
    loss_sum = torch.zeros(1)
    for microbatch in microbatches:
        loss, _, _ = objective.loss(microbatch, objective.forward(model, microbatch))
        loss.backward()
        loss_sum += float(loss)
    dist.all_reduce(loss_sum, group=group)
    differences["policy_loss"] = abs(float(loss_sum) / float(counts) - reference_loss)
    differences["policy_gradients"] = largest(reduced_gradients(model, float(counts)), reference_grads)

    # The logprob pass: this rank's rows as the padded pass gives them, and the first minibatch's
    # training logprobs bit-equal to the pass's (ratio exactly 1).
    model.eval()
    old = plan.logprobs([model], VOCAB, 0.7, 12)
    padded = logprobs.sequence_logprobs([model], mine.tokens, mine.prompt_lengths, mine.response_lengths,
                                        vocab_size=VOCAB, temperature=0.7, response_width=12)
    differences["logprobs"] = float((old - padded).abs().max())
    unequal = 0.0
    for microbatch in next(plan.minibatches(PolicyTargets(advantages=my_targets.advantages, old_logprobs=old), 1)):
        if microbatch.packed.lengths.numel() == 0:
            continue
        with torch.no_grad():
            trained, _ = response_logprobs_and_entropy(
                objective.forward(model, microbatch), microbatch.packed, microbatch.prompt_lengths,
                microbatch.response_lengths, vocab_size=VOCAB, temperature=0.7, response_width=12)
        unequal += float(not torch.equal(trained, microbatch.old_logprobs))
    differences["first_minibatch_unequal_micro_batches"] = unequal

    # DPO through the loader: 16 pairs, token-budget micro batches at DP=2 against 2 pairs per micro
    # batch in one process.
    from aligner.algorithms.dpo import DPOObjective, DPOSection
    from aligner.data.loader import MicroBatchLoader
    from aligner.data.preference import PreferenceDataset, collate_preferences
    from aligner.demo import arithmetic
    from aligner.demo.tokenizer import train_char_tokenizer
    from aligner.models import packing
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
    from aligner.tokenizer import Tokenizer

    scratch = tempfile.TemporaryDirectory()  # removed at exit: the data file is read lazily while training
    directory = scratch.name
    train_char_tokenizer(["0123456789+="], Path(directory))
    tokenizer = Tokenizer(directory)
    records = Path(directory) / "pairs.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in arithmetic.preference_records(16, seed=5)))
    dataset = PreferenceDataset.from_jsonl(records, tokenizer, 32)
    dataset.reference_logprobs = -torch.rand(len(dataset), 2, generator=torch.Generator().manual_seed(6)) * 10
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                    vocab_size=tokenizer.vocab_size, make_vocab_size_divisible_by=8, max_position_embeddings=64)
    torch.manual_seed(4)
    policy = build_gpt_model(cfg, transformer_config(cfg))
    objective = DPOObjective(DPOSection(beta=0.5, sft_loss_weight=0.3), cfg.vocab_size, packing.PackingSection(),
                             tokenizer.pad_id)

    def step(dp_rank, dp_size, budget):
        loader = MicroBatchLoader(dataset, global_batch_size=8, micro_batch_size=2, data_parallel_rank=dp_rank,
                                  data_parallel_size=dp_size, seed=3, shuffle=True, pad_id=tokenizer.pad_id,
                                  pad_to_multiple_of=8, collate_fn=collate_preferences,
                                  packing=packing.PackingSection(micro_batch_tokens=budget))
        policy.zero_grad(set_to_none=True)
        total, pairs = torch.zeros(1), torch.zeros(1)
        for batch in next(loader.iterate(0)):
            loss, count, _ = objective.loss(batch, objective.forward(policy, batch))
            loss.backward()
            total += float(loss)
            pairs += int(count)
        return total, pairs

    total, pairs = step(0, 1, None)
    reference = (float(total / pairs), {name: p.grad / float(pairs) for name, p in policy.named_parameters()})
    total, pairs = step(rank, ranks, 40)
    dist.all_reduce(total, group=group)
    dist.all_reduce(pairs, group=group)
    differences["dpo_loss"] = abs(float(total / pairs) - reference[0])
    differences["dpo_gradients"] = largest(reduced_gradients(policy, float(pairs)), reference[1])

    if dist.get_rank() == 0:
        with open(output, "w") as out:
            json.dump(differences, out)
    distributed.shutdown()


if __name__ == "__main__":
    main()
