"""The output layer at the positions a loss reads against the full logits, one trainer, steps alternating.

    .venv/bin/python benchmarks/output_layer_positions.py [--model smollm2|HF_DIR|GGUF|CHECKPOINT] \
        [--task sft|dpo|rl] [--steps 6] [--work DIR]

Builds our trainer for `train_steps.py`'s workload of the task (same model, data and sizes) and runs
its steps with the objective's `reads_logits_at_positions` on and off in turns (the first step of
each is a warm-up), so load hits both alike. Only the training forward/backward changes: the
logprob and reference passes apply the layer at the read positions either way. Prints each side's
median step time (RL: its training phase), the losses of the last pair of steps, and
`ratio output_layer_at_positions_TASK VALUE` = median over pairs of (full time / deferred time).
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
    parser.add_argument("--task", default="dpo", choices=("sft", "dpo", "rl"))
    parser.add_argument("--steps", type=int, default=6, help="steps per side, the first one untimed")
    parser.add_argument("--work", default=None)
    args = parser.parse_args()

    from aligner.config import run_main

    def run() -> None:
        import torch
        from peer.ours import ours_for_task

        torch.set_num_threads(2)
        with ours_for_task(args.task, args.model, 2 * args.steps, args.work) as ours:
            times: dict[bool, list[float]] = {True: [], False: []}
            last: dict[bool, float] = {}
            for index in range(2 * args.steps):
                deferred = (index % 4) in (0, 3)  # on, off, off, on: each side goes first as often
                ours.objective.reads_logits_at_positions = deferred
                metrics = ours.step()
                seconds = metrics["time_train"] if args.task == "rl" else metrics["seconds"]
                times[deferred].append(seconds)
                last[deferred] = metrics["grad_norm"] if args.task == "rl" else metrics["loss"]
                print(f"  step {index + 1}: {'at positions' if deferred else 'full logits '} {seconds:.3f} s",
                      file=sys.stderr, flush=True)
        timed = {side: values[1:] for side, values in times.items()}
        what = "training phase" if args.task == "rl" else "step"
        for side, label in ((True, "at the read positions"), (False, "full logits")):
            print(f"{args.task}: {label:<22} {what} median {statistics.median(timed[side]):.3f} s "
                  f"(min {min(timed[side]):.3f}, max {max(timed[side]):.3f})")
        print(f"{args.task}: last {'gradient norm' if args.task == 'rl' else 'loss'} of each side "
              f"{last[True]:.6g} / {last[False]:.6g} (different batches: equal only by chance)")
        ratio = statistics.median(full / deferred for full, deferred in zip(timed[False], timed[True]))
        print(f"ratio output_layer_at_positions_{args.task} {ratio:.3f}", flush=True)

    run_main(run)


if __name__ == "__main__":
    main()
