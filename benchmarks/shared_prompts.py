"""Packed RL rows that hold each prompt once against rows that repeat it per sample, one actor, steps alternating.

    .venv/bin/python benchmarks/shared_prompts.py [--model smollm2|toy|HF_DIR|GGUF|CHECKPOINT] \
        [--task grpo|rl] [--steps 6] [--work DIR]

Builds our RL actor for `train_steps.py`'s workload of the task (same model, prompts, samples and sizes)
and runs whole steps (generation, scoring, training) with `packing.share_prompts` on and off in turns
(on, off, off, on, ...; the first step of each side is a warm-up), so load hits both alike. Only the
training layout changes (the rows and their masks; with the default row length, rows twice as long in
half as many per micro batch). Prints each side's median step and training-phase time, the tokens the
training forward ran over per step, and `ratio shared_prompts_TASK VALUE` = median over pairs of
(unshared step / shared step), `ratio shared_prompts_train_TASK VALUE` the same for the training phase.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--task", default="grpo", choices=("grpo", "rl"))
    parser.add_argument("--steps", type=int, default=6, help="steps per side, the first one untimed")
    parser.add_argument("--work", default=None)
    args = parser.parse_args()

    from aligner.config import run_main

    def run() -> None:
        import torch
        from models import resolve_model
        from peer.workload import aligner_overrides, default_workload, write_data
        from train_steps import toy_checkpoint

        from aligner.algorithms.rl_actor import RLActorConfig, build_rl_actor
        from aligner.config import CONF_DIR, load_config

        torch.set_num_threads(2)
        toy = args.model == "toy"
        resolved = resolve_model(str(toy_checkpoint()) if toy else args.model)
        work = default_workload(args.task, 2 * args.steps, warmup_steps=0, toy=toy)
        with tempfile.TemporaryDirectory() as tmp:
            scratch = Path(args.work or tmp)
            data = write_data(work, scratch)
            yaml_name, overrides = aligner_overrides(work, resolved.checkpoint_dir, data, scratch / "ours")
            actor = build_rl_actor(load_config(RLActorConfig, CONF_DIR / yaml_name, overrides))
            trained_tokens: list[int] = []
            train_step = actor.policy.train_step

            def counting_train_step(microbatches):
                trained_tokens.append(sum(m.real_tokens for m in microbatches))
                return train_step(microbatches)

            actor.policy.train_step = counting_train_step
            results: dict[bool, list[tuple[float, float, int]]] = {True: [], False: []}
            try:
                for index in range(2 * args.steps):
                    shared = (index % 4) in (0, 3)  # on, off, off, on: each side goes first as often
                    actor.cfg.packing.share_prompts = shared
                    trained_tokens.clear()
                    started = time.perf_counter()
                    metrics = actor.train_step()
                    seconds = time.perf_counter() - started
                    actor.step += 1
                    results[shared].append((seconds, metrics["time_train"], sum(trained_tokens)))
                    print(f"  step {index + 1}: {'shared  ' if shared else 'unshared'} {seconds:.3f} s, training "
                          f"{metrics['time_train']:.3f} s over {sum(trained_tokens)} tokens", file=sys.stderr,
                          flush=True)
            finally:
                actor.router.close()
                actor.reward_source.close()
        timed = {side: values[1:] for side, values in results.items()}
        for side, label in ((True, "prompts shared"), (False, "prompt per sample")):
            steps, trains, tokens = zip(*timed[side])
            print(f"{args.task}: {label:<18} step median {statistics.median(steps):.3f} s (min {min(steps):.3f}, "
                  f"max {max(steps):.3f}), training phase {statistics.median(trains):.3f} s, "
                  f"{statistics.median(tokens):.0f} tokens trained on per step")
        pairs = list(zip(timed[False], timed[True]))
        print(f"ratio shared_prompts_{args.task} {statistics.median(off[0] / on[0] for off, on in pairs):.3f}")
        print(f"ratio shared_prompts_train_{args.task} {statistics.median(off[1] / on[1] for off, on in pairs):.3f}",
              flush=True)

    run_main(run)


if __name__ == "__main__":
    main()
