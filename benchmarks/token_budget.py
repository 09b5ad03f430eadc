"""Fixed-size vs token-budget micro batches (packing.micro_batch_tokens) at DP=2: rank imbalance and step time.

    PYTHONPATH=. .venv/bin/python benchmarks/token_budget.py [--task rl|dpo] [--model toy|smollm2|PATH]

A global minibatch of variable-length sequences is split over `--ranks` data-parallel ranks two ways:
  fixed   what the trainers do without a budget: rank r takes its contiguous share (the RL actor's
          rollouts stay on the rank that generated them; the DPO sampler hands out consecutive pairs),
          cut into micro batches of `--micro` packed rows of `--row-length` tokens (RL), or of `--micro`
          pairs packed into such rows (DPO);
  budget  `aligner.models.packing.plan_token_budget`: the items balanced across ranks by tokens,
          micro batches of at most `--micro` x `--row-length` tokens (the same memory ceiling).
RL lengths come in groups of `--samples` per prompt whose responses share a length scale (a hard
prompt's samples all run long), the case that leaves one rank with far more tokens.

--share-prompts: a group's samples (a pair's two sequences) hold one prompt, once per packed row as the
trainers lay them out (`packing.share_prompts`), and the two layouts compared are token budgets both:
  unshared  the plan counting every sequence with its own prompt, laid out sharing (as before the
            plan knew of shared prompts);
  budget    the plan counting each prompt once per micro batch (`plan_token_budget` with prompts; RL:
            a prompt's samples planned together, `shared_prompt_parts`, as the RL actor plans them).

Each rank's micro batches run forward + backward (the packed response logprobs summed) in this one
process, rank after rank, layouts alternating per repeat so load hits both. A data-parallel step
waits at the gradient all-reduce for its slowest rank, so the step time of a layout is its slowest
rank's time; a repeat runs one step per random minibatch (`--draws`) and sums them. Prints tokens,
micro batches and packed cells per rank, per-repeat times with the load average beside each, and
(fixed / budget) `ratio token_budget_<task>_dp<ranks>_step` (the draws' steps, best repeat, wall
time; `_step_cpu` in process CPU time, robust to load), `_tokens` (the largest rank's real tokens)
and `_cells` (its packed tokens, tail padding included: the work the step waits for, independent of
load), the last two averaged over the draws.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer.protocol import in_turn  # noqa: E402


def load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def build_model(spec: str):
    from aligner.models.gpt import GPTConfig, build_model_chunks
    from aligner.runtime import distributed

    if spec == "toy":
        cfg = GPTConfig.llama(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                              vocab_size=256, make_vocab_size_divisible_by=8, max_position_embeddings=1024)
        return build_model_chunks(cfg, distributed.ParallelConfig(), torch.float32)[0], cfg
    from models import resolve_model

    from aligner import checkpointing

    checkpoint = resolve_model(spec).checkpoint_dir
    cfg = GPTConfig.from_dict(checkpointing.read_meta(checkpoint)["model"])
    chunks = build_model_chunks(cfg, distributed.ParallelConfig(), torch.float32)
    checkpointing.load(checkpoint, chunks)
    return chunks[0], cfg


def make_items(args, generator) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt lengths, response lengths) per item: one sequence (rl) or a pair (dpo) each."""
    prompts, responses = [], []
    groups = args.items // args.samples if args.task == "rl" else args.items
    for _ in range(groups):
        scale = int(torch.randint(args.response_min, args.max_new_tokens + 1, (1,), generator=generator))
        prompt = int(torch.randint(args.prompt_min, args.max_prompt + 1, (1,), generator=generator))
        count = args.samples if args.task == "rl" else 1
        for _ in range(count):
            response = [int(torch.randint(args.response_min, scale + 1, (1,), generator=generator))
                        for _ in range(1 if args.task == "rl" else 2)]
            prompts.append([prompt] * len(response))
            responses.append(response)
    return prompts, responses


def plans(args, sizes: list[int], rows_of, sequences, keys) -> dict[str, list[list[list[list[int]]]]]:
    """{layout: [rank][micro batch] -> sequence indices per item}; keys: per sequence (prompt length,
    prompt tokens) with --share-prompts."""
    from aligner.models import packing

    items = [[len(sequences[r]) for r in rows] for rows in rows_of]
    budget = args.micro * args.row_length
    if args.share_prompts:
        unshared = packing.plan_token_budget(items, args.ranks, budget, args.row_length)
        groups = rows_of
        if args.task == "rl":  # as the RL actor: a prompt's samples that share a row, one item
            groups = packing.shared_prompt_parts([len(s) for s in sequences], [k[0] for k in keys],
                                                 [k[1] for k in keys], args.row_length)
        shared = packing.plan_token_budget([[len(sequences[r]) for r in group] for group in groups], args.ranks,
                                           budget, args.row_length, [[keys[r] for r in group] for group in groups])
        return {"unshared": [[[rows_of[i] for i in batch] for batch in plan] for plan in unshared],
                "budget": [[[groups[i] for i in batch] for batch in plan] for plan in shared]}
    per_rank = len(sizes) // args.ranks
    fixed = []
    for rank in range(args.ranks):
        share = list(range(rank * per_rank, (rank + 1) * per_rank))
        if args.task == "rl":  # the actor: the share first-fit into rows, `micro` rows per micro batch
            rows = packing.first_fit_rows([sizes[i] for i in share], args.row_length)
            fixed.append([[share[i] for row in rows[start:start + args.micro] for i in row]
                          for start in range(0, len(rows), args.micro)])
        else:  # the loader: `micro` pairs per micro batch
            fixed.append([share[start:start + args.micro] for start in range(0, per_rank, args.micro)])
    planned = packing.plan_token_budget(items, args.ranks, budget, args.row_length)
    return {name: [[[rows_of[i] for i in batch] for batch in plan] for plan in by_rank]
            for name, by_rank in (("fixed", fixed), ("budget", planned))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("rl", "dpo"), default="rl")
    parser.add_argument("--model", default="toy", help="toy (a random 4-layer, 128-wide llama), smollm2, or a path")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--items", type=int, default=64, help="sequences (rl) or pairs (dpo) in the global minibatch")
    parser.add_argument("--samples", type=int, default=4, help="rl: samples per prompt (one length scale each)")
    parser.add_argument("--micro", type=int, default=4, help="packed rows (rl) or pairs (dpo) per fixed micro batch")
    parser.add_argument("--prompt-min", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=64)
    parser.add_argument("--response-min", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=5, help="timed passes of each layout (draw 0)")
    parser.add_argument("--draws", type=int, default=8, help="random minibatches for the token and cell ratios")
    parser.add_argument("--threads", type=int, default=1, help="per simulated rank (a rank has its own cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--share-prompts", action="store_true",
                        help="a group's samples (a pair) share one prompt, held once per packed row; compares the "
                             "budget planned with each sequence's own prompt against planned with it once")
    args = parser.parse_args()
    args.row_length = args.max_prompt + args.max_new_tokens
    if args.repeats < 1 or args.draws < 1:
        parser.error("--repeats and --draws must be at least 1")
    torch.set_num_threads(args.threads)

    from run_bench import ratio_line

    from aligner.models import packing
    from aligner.models.packed_logprobs import response_logprobs_and_entropy
    from aligner.runtime import distributed, seeds

    distributed.initialize(distributed.ParallelConfig())
    seeds.set_seed(0)
    model, cfg = build_model(args.model)
    model.train()
    def draw(seed: int):
        """One random global minibatch: its two layouts, built, and their per-rank statistics printed."""
        generator = torch.Generator().manual_seed(seed)
        prompts, responses = make_items(args, generator)
        sequences, prompt_of, response_of, rows_of = [], [], [], []
        group_prompt = None
        for index, (item_prompts, item_responses) in enumerate(zip(prompts, responses)):
            rows_of.append(list(range(len(sequences), len(sequences) + len(item_prompts))))
            if args.share_prompts and index % (args.samples if args.task == "rl" else 1) == 0:  # a new prompt
                group_prompt = torch.randint(3, cfg.vocab_size, (item_prompts[0],), generator=generator)
            for prompt, response in zip(item_prompts, item_responses):
                sequence = torch.randint(3, cfg.vocab_size, (prompt + response,), generator=generator)
                if args.share_prompts:
                    sequence[:prompt] = group_prompt
                sequences.append(sequence)
                prompt_of.append(prompt)
                response_of.append(response)
        sizes = [sum(len(sequences[r]) for r in rows) for rows in rows_of]
        keys = [(prompt_of[r], tuple(sequences[r][:prompt_of[r]].tolist()))
                for r in range(len(sequences))] if args.share_prompts else None
        layouts = plans(args, sizes, rows_of, sequences, keys)

        def micro_batches(plan_of_rank):
            built = []
            for items in plan_of_rank:
                if not items:
                    built.append(None)
                    continue
                members = [r for item in items for r in item]
                lengths = [len(sequences[r]) for r in members]
                shared = ([keys[r][0] for r in members], [keys[r][1] for r in members]) if keys else None
                rows = packing.packed_rows_plan(lengths, args.row_length, shared, no_more_rows=True)
                _, packed = packing.pack_micro_batch([sequences[r] for r in members], rows, args.row_length, 0,
                                                     prompt_lengths=shared and shared[0])
                order = [members[i] for row in rows for i in row]
                built.append((packed, torch.tensor([prompt_of[r] for r in order]),
                              torch.tensor([response_of[r] for r in order])))
            return built

        built = {name: [micro_batches(plan) for plan in plan_by_rank] for name, plan_by_rank in layouts.items()}
        print(f"draw {seed}: {args.items} items ({len(sequences)} sequences, {sum(sizes)} tokens)")
        largest = {}
        for name, plan_by_rank in layouts.items():
            rank_tokens = [sum(len(sequences[r]) for batch in plan for item in batch for r in item)
                           for plan in plan_by_rank]
            cells = [sum(b[0].tokens.numel() for b in ranks if b is not None) for ranks in built[name]]
            largest[name] = (max(rank_tokens), max(cells))
            print(f"  {name:6s}: tokens per rank {rank_tokens} (largest / mean "
                  f"{max(rank_tokens) * args.ranks / sum(sizes):.3f}), micro batches per rank "
                  f"{[len(plan) for plan in plan_by_rank]}, packed cells per rank {cells}")
        return built, largest

    print(f"{args.task} over {args.ranks} ranks; model {args.model}; row length {args.row_length}, fixed micro "
          f"batch {args.micro}, budget {args.micro * args.row_length} tokens; {args.threads} thread(s) per rank; "
          f"load {load()}")
    draws = [draw(args.seed + offset) for offset in range(args.draws)]

    def run_rank(batches) -> tuple[float, float]:
        """(wall, process CPU) seconds of one rank's micro batches."""
        start, cpu = time.perf_counter(), time.process_time()
        for batch in batches:
            if batch is None:  # an empty micro batch: a one-token forward, zero loss
                output = packing.packed_forward(model, packing.empty_packed_rows(0))
                packing.zero_loss(output).backward()
                continue
            packed, prompt_lengths, response_lengths = batch
            logprobs, _ = response_logprobs_and_entropy(
                packing.packed_forward(model, packed), packed, prompt_lengths, response_lengths,
                vocab_size=cfg.vocab_size, response_width=int(response_lengths.max()), with_entropy=False)
            logprobs.sum().backward()
        return time.perf_counter() - start, time.process_time() - cpu

    baseline = "unshared" if args.share_prompts else "fixed"
    run_rank(draws[0][0][baseline][0][:1])  # warm-up
    steps = {baseline: [], "budget": []}  # per repeat: (wall, cpu) summed over the draws' slowest ranks
    for repeat in range(args.repeats):
        for name in in_turn((baseline, "budget"), repeat):
            wall_sum = cpu_sum = 0.0
            for built, _ in draws:  # one step per draw
                model.zero_grad(set_to_none=True)
                times = [run_rank(batches) for batches in built[name]]
                wall_sum += max(wall for wall, _ in times)
                cpu_sum += max(cpu for _, cpu in times)
            steps[name].append((wall_sum, cpu_sum))
            print(f"  repeat {repeat} {name:6s}: {args.draws} steps (slowest rank each) {wall_sum:.2f} s wall, "
                  f"{cpu_sum:.2f} s cpu; load {load()}")
    best = {name: [min(step[kind] for step in steps[name]) for kind in (0, 1)] for name in steps}
    print(f"{args.draws} steps, best of {args.repeats}: {baseline} {best[baseline][0]:.2f} s wall "
          f"{best[baseline][1]:.2f} s cpu, budget {best['budget'][0]:.2f} s wall {best['budget'][1]:.2f} s cpu, "
          f"load {load()}")
    name = f"token_budget_{args.task}_dp{args.ranks}" + ("_shared_prompts" if args.share_prompts else "")
    print(ratio_line(f"{name}_step", best[baseline][0] / best["budget"][0]))
    print(ratio_line(f"{name}_step_cpu", best[baseline][1] / best["budget"][1]))
    for index, what in ((0, "tokens"), (1, "cells")):  # the largest rank's, baseline / budget, mean over the draws
        print(ratio_line(f"{name}_{what}", sum(largest[baseline][index] / largest["budget"][index]
                                               for _, largest in draws) / len(draws)))
    distributed.shutdown()


if __name__ == "__main__":
    main()
