"""Padded vs packed training batches on a real model: padding share, forward and forward+backward time.

    PYTHONPATH=. .venv/bin/python benchmarks/packing.py [--task rl|dpo] [--model smollm2] [--repeats 2]

--task rl: a minibatch of `--rollouts` sequences (prompt lengths uniform in [--prompt-min,
--max-prompt], response lengths uniform in [--response-min, --max-new-tokens]); padded, every row
has the RL actor's max_prompt + max_new_tokens columns; packed, the whole minibatch is laid in rows
of that length, `--micro` rows per micro batch (what the actor does).
--task dpo: `--rollouts` / 2 pairs (one prompt, two responses each); padded, micro batches of
`--micro` rows padded to their longest; packed, each micro batch's rows laid in rows of that length
(what the DPO trainer does).
Per repeat, the same model runs both layouts in alternation (so machine load hits both): a no-grad
logprob pass (old/reference logprobs) and a forward+backward of the summed response logprobs (the
update). It prints the padding share of each layout, the largest logprob difference, and per
repeat the time ratio padded / packed in wall time and in this process's CPU time, with the load
average beside every number.
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


def load_model(checkpoint_dir):
    from aligner import checkpointing
    from aligner.models.gpt import GPTConfig, build_model_chunks
    from aligner.runtime import distributed

    meta = checkpointing.read_meta(checkpoint_dir)
    model_cfg = GPTConfig.from_dict(meta["model"])
    chunks = build_model_chunks(model_cfg, distributed.ParallelConfig(), torch.float32)
    checkpointing.load(checkpoint_dir, chunks)
    return chunks, model_cfg


def load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("rl", "dpo"), default="rl")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--prompt-min", type=int, default=20)
    parser.add_argument("--max-prompt", type=int, default=64)
    parser.add_argument("--response-min", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from models import resolve_model

    from aligner.models import packing
    from aligner.models.logprobs import response_logprobs
    from aligner.models.packed_logprobs import response_logprobs_and_entropy as packed_response_logprobs
    from aligner.runtime import distributed, seeds

    distributed.initialize(distributed.ParallelConfig())
    seeds.set_seed(0)
    chunks, model_cfg = load_model(resolve_model(args.model).checkpoint_dir)
    vocab = model_cfg.vocab_size
    generator = torch.Generator().manual_seed(0)
    if args.task == "rl":
        prompts = torch.randint(args.prompt_min, args.max_prompt + 1, (args.rollouts,), generator=generator)
    else:  # pairs: chosen and rejected share the prompt
        prompts = torch.randint(args.prompt_min, args.max_prompt + 1, (args.rollouts // 2,),
                                generator=generator).repeat_interleave(2)
    responses = torch.randint(args.response_min, args.max_new_tokens + 1, (len(prompts),), generator=generator)
    width = args.max_new_tokens
    lengths = (prompts + responses).tolist()
    sequences = [torch.randint(3, vocab, (length,), generator=generator) for length in lengths]
    # Padded micro batches: (sequence indices, padded length); packed: (rows of indices, row length).
    padded_plan, packed_plan = [], []
    for start in range(0, len(lengths), args.micro):
        members = list(range(start, min(start + args.micro, len(lengths))))
        padded_plan.append((members, args.max_prompt + width if args.task == "rl"
                            else max(lengths[i] for i in members)))
        if args.task == "dpo":
            rows = packing.first_fit_rows([lengths[i] for i in members], padded_plan[-1][1])
            packed_plan.append(([[members[i] for i in row] for row in rows], padded_plan[-1][1]))
    if args.task == "rl":
        packed_plan = [(rows, args.max_prompt + width)
                       for rows in packing.plan_micro_batches(lengths, args.max_prompt + width, args.micro)]
    real = sum(lengths)
    padded_slots = sum(len(members) * length for members, length in padded_plan)
    packed_slots = sum(len(rows) * length for rows, length in packed_plan)
    print(f"{args.task}: {len(lengths)} sequences, real tokens {real}; padded {len(padded_plan)} micro batches, "
          f"{padded_slots} token slots (padding {1 - real / padded_slots:.1%}); packed {len(packed_plan)} micro "
          f"batches, {sum(len(rows) for rows, _ in packed_plan)} rows, {packed_slots} token slots (padding "
          f"{1 - real / packed_slots:.1%})")
    model = chunks[0]

    def padded_batch(members, length):
        tokens = torch.zeros(len(members), length, dtype=torch.long)
        for row, index in enumerate(members):
            tokens[row, :lengths[index]] = sequences[index]
        index = torch.tensor(members)
        logits = model(tokens, torch.arange(length).expand(len(members), -1), None)
        return response_logprobs(logits, tokens, prompts[index], responses[index], vocab_size=vocab,
                                 response_width=width), index

    def packed_batch(rows, length):  # read in place from the packed logits, as the trainers do
        members, packed = packing.pack_micro_batch(sequences, rows, length, 0)
        index = torch.tensor(members)
        logprobs, _ = packed_response_logprobs(packing.packed_forward(model, packed), packed, prompts[index],
                                               responses[index], vocab_size=vocab, response_width=width,
                                               with_entropy=False)
        return logprobs, index

    def run(plan, make_batch, train):
        model.train(train)
        result = torch.zeros(len(lengths), width)
        with torch.set_grad_enabled(train):
            for part, length in plan:
                logprobs, index = make_batch(part, length)
                if train:
                    logprobs.sum().backward()
                result[index] = logprobs.detach()
        return result

    def padded_logprobs():
        return run(padded_plan, padded_batch, False)

    def packed_logprobs():
        return run(packed_plan, packed_batch, False)

    def padded_train():
        run(padded_plan, padded_batch, True)

    def packed_train():
        run(packed_plan, packed_batch, True)

    difference = (padded_logprobs() - packed_logprobs()).abs().max().item()
    print(f"largest |padded - packed| logprob: {difference:.3g}")
    for name, padded, packed in (("logprob pass", padded_logprobs, packed_logprobs),
                                 ("forward+backward", padded_train, packed_train)):
        for repeat in range(args.repeats):
            times = {}
            for side, call in in_turn((("padded", padded), ("packed", packed)), repeat):
                before = load()
                tick, cpu_tick = time.perf_counter(), time.process_time()
                call()
                times[side] = time.perf_counter() - tick
                times[side + "_cpu"] = time.process_time() - cpu_tick
                times[side + "_load"] = f"{before}->{load()}"
            model.zero_grad(set_to_none=True)
            print(f"{name} #{repeat}: padded {times['padded']:.2f} s (cpu {times['padded_cpu']:.2f} s, load "
                  f"{times['padded_load']}), packed {times['packed']:.2f} s (cpu {times['packed_cpu']:.2f} s, load "
                  f"{times['packed_load']}): ratio padded/packed wall {times['padded'] / times['packed']:.2f}, "
                  f"cpu {times['padded_cpu'] / times['packed_cpu']:.2f}", flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main()
