"""Packed rows that hold each prompt once against rows that repeat it per sequence, one trainer, steps alternating.

    .venv/bin/python benchmarks/shared_prompts.py [--model smollm2|toy|HF_DIR|GGUF|CHECKPOINT] \
        [--task grpo|rl|dpo] [--steps 6] [--work DIR]

Builds our trainer for `train_steps.py`'s workload of the task (same model, data and sizes) and runs
whole steps (RL: generation, scoring, training; DPO: the batch with its swapped-in reference pass and
the update) with `packing.share_prompts` on and off in turns (on, off, off, on, ...; the first step of
each side is a warm-up), so load hits both alike. Only the packed layout changes (which sequences
share a row, the rows' masks and lengths). Prints each side's median step time (RL also its training
phase), the tokens the training forwards ran over per step, and `ratio shared_prompts_TASK VALUE` =
median over pairs of (unshared step / shared step); RL adds `ratio shared_prompts_train_TASK VALUE`,
the same for the training phase.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--task", default="grpo", choices=("grpo", "rl", "dpo"))
    parser.add_argument("--steps", type=int, default=6, help="steps per side, the first one untimed")
    parser.add_argument("--work", default=None)
    args = parser.parse_args()

    from aligner.config import run_main

    def run() -> None:
        import torch
        from peer.ours import ours_for_task
        from train_steps import toy_checkpoint

        torch.set_num_threads(2)
        toy = args.model == "toy"
        rl = args.task != "dpo"
        with ours_for_task(args.task, str(toy_checkpoint()) if toy else args.model, 2 * args.steps, args.work,
                           toy=toy) as ours:
            trained_tokens: list[int] = []
            forward = ours.objective.forward

            def counting_forward(model, batch):
                output = forward(model, batch)
                packed = batch.get("packed") if isinstance(batch, dict) else getattr(batch, "packed", None)
                trained_tokens.append(0 if packed is None else packed.real_tokens)
                return output

            ours.objective.forward = counting_forward
            results: dict[bool, list[tuple[float, float, int]]] = {True: [], False: []}
            for index in range(2 * args.steps):
                shared = (index % 4) in (0, 3)  # on, off, off, on: each side goes first as often
                ours.config.packing.share_prompts = shared
                trained_tokens.clear()
                metrics = ours.step()
                seconds = metrics["seconds"]
                train_seconds = metrics["time_train"] if rl else seconds
                results[shared].append((seconds, train_seconds, sum(trained_tokens)))
                print(f"  step {index + 1}: {'shared  ' if shared else 'unshared'} {seconds:.3f} s"
                      + (f", training {train_seconds:.3f} s" if rl else "")
                      + f" over {sum(trained_tokens)} tokens", file=sys.stderr, flush=True)
        timed = {side: values[1:] for side, values in results.items()}
        for side, label in ((True, "prompts shared"), (False, "prompt per sequence")):
            steps, trains, tokens = zip(*timed[side])
            print(f"{args.task}: {label:<20} step median {statistics.median(steps):.3f} s (min {min(steps):.3f}, "
                  f"max {max(steps):.3f})" + (f", training phase {statistics.median(trains):.3f} s" if rl else "")
                  + f", {statistics.median(tokens):.0f} tokens in the training forwards per step")
        pairs = list(zip(timed[False], timed[True]))
        print(f"ratio shared_prompts_{args.task} {statistics.median(off[0] / on[0] for off, on in pairs):.3f}")
        if rl:
            print(f"ratio shared_prompts_train_{args.task} "
                  f"{statistics.median(off[1] / on[1] for off, on in pairs):.3f}")
        sys.stdout.flush()

    run_main(run)


if __name__ == "__main__":
    main()
