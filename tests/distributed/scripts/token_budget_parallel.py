"""Token-budget micro batches at DP=2 (torchrun, gloo) against the fixed-size ones of one process: the RL
policy loss and gradients, the RL actor's logprob pass (and its first minibatch's logprobs, which must
be bit-equal to the pass's), and DPO's loss and gradients through the micro-batch loader. Every rank
also computes the single-process reference itself; rank 0 writes the largest differences.

    torchrun --nproc_per_node 2 token_budget_parallel.py OUTPUT_JSON
"""
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist


def main() -> None:
    from megatron.core import parallel_state as ps

    from aligner.generation import logprobs
    from aligner.generation.packed_logprobs import response_logprobs_and_entropy
    from aligner.runtime import distributed, seeds
    from tests.unit.test_packing import VOCAB, _policy_actor, _tiny_model
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
    everything = _experience(per_rank * ranks, seed=11)
    settings = ["loss.aggregation=sequence_mean_token_mean", f"trainer.global_batch_size={per_rank * ranks}"]
    fixed = _policy_actor(["packing.enabled=false", *settings])
    alone = [dist.new_group([member]) for member in range(ranks)]  # every rank creates every group
    fixed.dp_group = alone[rank]
    positions = torch.arange(24).unsqueeze(0).expand(2, -1)
    reference_loss, reference_grads = _minibatch_loss_and_gradients(
        model, fixed, fixed.policy_microbatches(everything, torch.arange(per_rank * ranks), positions))
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    batch = everything.batch
    mine = replace(everything, batch=SimpleNamespace(
        tokens=batch.tokens[local], prompt_lengths=batch.prompt_lengths[local],
        response_lengths=batch.response_lengths[local], mask=batch.mask[local]),
        old_logprobs=everything.old_logprobs[local], advantages=everything.advantages[local])
    actor = _policy_actor(["packing.micro_batch_tokens=40", *settings])
    actor.dp_group, actor.dp_rank, actor.dp_size, actor.step = group, rank, ranks, 0
    gathered = actor.all_ranks_experience(mine)
    assert torch.equal(gathered.batch.tokens, batch.tokens) and torch.equal(gathered.advantages, everything.advantages)
    microbatches = actor.scale_losses(actor.policy_microbatches(gathered, torch.arange(0), positions,
                                                                actor.budget_plan(gathered.batch, 0, 0)))
    counts = torch.tensor([float(len(microbatches))])
    dist.all_reduce(counts, group=group)
    model.zero_grad(set_to_none=True)
    loss_sum = torch.zeros(1)
    for microbatch in microbatches:
        loss, _, _ = actor.objective.loss(microbatch, actor.objective.forward(model, microbatch))
        loss.backward()
        loss_sum += float(loss)
    dist.all_reduce(loss_sum, group=group)
    differences["policy_loss"] = abs(float(loss_sum) / float(counts) - reference_loss)
    differences["policy_gradients"] = largest(reduced_gradients(model, float(counts)), reference_grads)

    # The logprob pass: this rank's rows as the padded pass gives them, and the first minibatch's
    # training logprobs bit-equal to the pass's (ratio exactly 1).
    model.eval()
    actor.chunks, actor.model_cfg, actor.temperature, actor.response_width = [model], SimpleNamespace(
        vocab_size=VOCAB), 0.7, 12
    old = actor.logprobs(mine.batch)
    padded = logprobs.sequence_logprobs([model], mine.batch.tokens, mine.batch.prompt_lengths,
                                        mine.batch.response_lengths, vocab_size=VOCAB, temperature=0.7,
                                        response_width=12)
    differences["logprobs"] = float((old - padded).abs().max())
    gathered.old_logprobs = actor.gather_rows(old)
    unequal = 0.0
    for microbatch in actor.policy_microbatches(gathered, torch.arange(0), positions,
                                                actor.budget_plan(gathered.batch, 0, 0)):
        if microbatch.packed.lengths.numel() == 0:
            continue
        with torch.no_grad():
            trained, _ = response_logprobs_and_entropy(
                actor.objective.forward(model, microbatch), microbatch.packed, microbatch.prompt_lengths,
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
