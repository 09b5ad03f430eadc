"""Padded vs packed training batches on a real model: padding share, forward and forward+backward time.

    PYTHONPATH=. .venv/bin/python benchmarks/packing.py [--model smollm2] [--repeats 3] [--threads 2]

An RL minibatch of `--rollouts` sequences (prompt lengths uniform in [--prompt-min, --max-prompt],
response lengths uniform in [--response-min, --max-new-tokens]; the RL actor's padded layout is
max_prompt + max_new_tokens columns per row) runs through the same model twice per repeat, padded
and packed (rows of that same length, first fit longest first), in alternation so machine load
hits both: a no-grad logprob pass (the actor's old/reference logprobs) and a forward+backward of
the summed response logprobs (the policy update), both in micro batches of `--micro` rows. It
prints the padding share of each layout, the largest logprob difference between them, and per
repeat the time ratio padded / packed, with the load average beside every number.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


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
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--prompt-min", type=int, default=20)
    parser.add_argument("--max-prompt", type=int, default=64)
    parser.add_argument("--response-min", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from models import resolve_model

    from aligner.generation.logprobs import response_logprobs, sequence_logprobs
    from aligner.models import packing
    from aligner.runtime import distributed, seeds

    distributed.initialize(distributed.ParallelConfig())
    seeds.set_seed(0)
    chunks, model_cfg = load_model(resolve_model(args.model).checkpoint_dir)
    vocab = model_cfg.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(args.prompt_min, args.max_prompt + 1, (args.rollouts,), generator=generator)
    responses = torch.randint(args.response_min, args.max_new_tokens + 1, (args.rollouts,), generator=generator)
    seq_length, width = args.max_prompt + args.max_new_tokens, args.max_new_tokens
    tokens = torch.zeros(args.rollouts, seq_length, dtype=torch.long)
    for row in range(args.rollouts):
        length = int(prompts[row] + responses[row])
        tokens[row, :length] = torch.randint(3, vocab, (length,), generator=generator)
    lengths = (prompts + responses).tolist()
    plan = packing.plan_micro_batches(lengths, seq_length, args.micro)
    real = sum(lengths)
    packed_rows = sum(len(rows) for rows in plan)
    print(f"rollouts {args.rollouts}, real tokens {real}; padded {args.rollouts} rows x {seq_length} "
          f"(padding {1 - real / (args.rollouts * seq_length):.1%}, {1 - real / (args.rollouts * max(lengths)):.1%} "
          f"if padded only to the longest); packed {packed_rows} rows x {seq_length} "
          f"(padding {1 - real / (packed_rows * seq_length):.1%}), {len(plan)} vs "
          f"{-(-args.rollouts // args.micro)} micro batches")
    section = packing.PackingSection()
    model = chunks[0]

    def padded_logprobs():
        return sequence_logprobs(chunks, tokens, prompts, responses, vocab_size=vocab, response_width=width,
                                 micro_batch_size=args.micro)

    def packed_logprobs():
        return packing.sequence_logprobs(chunks, tokens, prompts, responses, vocab_size=vocab, packing=section,
                                         pad_id=0, response_width=width, micro_batch_size=args.micro)

    def padded_train():
        model.train()
        for start in range(0, args.rollouts, args.micro):
            rows = slice(start, start + args.micro)
            logits = model(tokens[rows], torch.arange(seq_length).expand(len(tokens[rows]), -1), None)
            response_logprobs(logits, tokens[rows], prompts[rows], responses[rows], vocab_size=vocab,
                              response_width=width).sum().backward()

    sequences = [tokens[row, :length] for row, length in enumerate(lengths)]

    def packed_train():
        model.train()
        for rows in plan:
            members, packed = packing.pack_micro_batch(sequences, rows, seq_length, 0)
            index = torch.tensor(members)
            window, window_tokens = packing.response_window(packing.packed_forward(model, packed), packed,
                                                            prompts[index], width)
            response_logprobs(window, window_tokens, torch.ones_like(index), responses[index], vocab_size=vocab,
                              response_width=width).sum().backward()

    difference = (padded_logprobs() - packed_logprobs()).abs().max().item()
    print(f"largest |padded - packed| logprob: {difference:.3g}")
    for name, padded, packed in (("logprob pass", padded_logprobs, packed_logprobs),
                                 ("forward+backward", padded_train, packed_train)):
        for repeat in range(args.repeats):
            times = {}
            for side, run in (("padded", padded), ("packed", packed)) if repeat % 2 == 0 else (
                    ("packed", packed), ("padded", padded)):
                before = load()
                tick = time.perf_counter()
                run()
                times[side] = time.perf_counter() - tick
                times[side + "_load"] = f"{before}->{load()}"
            model.zero_grad(set_to_none=True)
            print(f"{name} #{repeat}: padded {times['padded']:.2f} s (load {times['padded_load']}), packed "
                  f"{times['packed']:.2f} s (load {times['packed_load']}): ratio padded/packed "
                  f"{times['padded'] / times['packed']:.2f}", flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main()
