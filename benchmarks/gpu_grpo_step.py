"""A GRPO step on one GPU, in tokens per second per GPU (the figure NeMo-RL and verl publish).

    python benchmarks/gpu_grpo_step.py [--model smollm2] [--prompts 64] [--samples 4] [--new-tokens 128]
        [--steps 3] [--warmup 1] [--precision bf16] [--micro-batch 64]

The actor is built as its entry point builds it (aligner/conf/gpt_reinforce_actor.yaml plus the overrides of
`peer.workload.aligner_overrides`, the settings the CPU comparison with TRL uses), with a function reward
(the share of vowels in the response), fixed-length responses (min = max new tokens), one epoch of one
minibatch, KL 0. Prints per step: seconds, generated tokens/s, tokens/s counting prompt and response
tokens of the step's sequences, and where the step's time goes (generation, training, ...), then
`ratio gpu_grpo_tokens_per_s_per_gpu VALUE` (a rate, not a ratio against a peer: no peer runs here).
Runs on the CPU too (slowly; use small --prompts/--new-tokens there).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
sys.path.insert(0, str(REPO_ROOT))

from peer.workload import Workload, aligner_overrides, write_data  # noqa: E402

from benchmarks.run_bench import ratio_line  # noqa: E402


def prompt_tokens_per_step(data: Path, tokenizer, prompts: int, steps: int) -> list[int]:
    """Tokens of each step's prompts as the actor encodes them (chat template; data.shuffle=false: in order)."""
    records = [json.loads(line) for line in data.read_text().splitlines()]
    lengths = [len(tokenizer.encode_chat(r["prompt"], add_generation_prompt=True)[0]) for r in records]
    return [sum(lengths[s * prompts:(s + 1) * prompts]) for s in range(steps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, an HF dir, a .gguf file or an aligner checkpoint")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=64, help="training micro batch (responses)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    import torch

    from aligner.algorithms.rl_build import build_rl_actor
    from aligner.algorithms.rl_config import RLActorConfig
    from aligner.config import CONF_DIR, load_config
    from benchmarks.models import resolve_model

    rollouts = args.prompts * args.samples
    work = Workload("grpo", args.steps, args.warmup, rollouts, min(args.micro_batch, rollouts), 0,
                    prompts_per_step=args.prompts, samples_per_prompt=args.samples, max_new_tokens=args.new_tokens)
    resolved = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        data = write_data(work, scratch)
        yaml_name, overrides = aligner_overrides(work, resolved.checkpoint_dir, data, scratch / "run")
        overrides = [o for o in overrides if not o.startswith("precision=")] + [f"precision={args.precision}"]
        actor = build_rl_actor(load_config(RLActorConfig, CONF_DIR / yaml_name, overrides))
        device = next(actor.chunks[0].parameters()).device
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        prompt_tokens = prompt_tokens_per_step(data, actor.tokenizer, args.prompts, work.total_steps)
        print(f"GRPO step on {where}: {resolved.spec}, {args.prompts} prompts x {args.samples} samples x "
              f"{args.new_tokens} new tokens (fixed length), training micro batch {work.micro_batch_size}, "
              f"{args.precision}; {args.steps} timed steps after {args.warmup} warm-up", flush=True)
        timed = []
        try:
            for step in range(work.total_steps):
                start = time.perf_counter()
                metrics = actor.train_step()
                actor.step += 1
                seconds = time.perf_counter() - start
                tokens = prompt_tokens[step] * args.samples + metrics["generated_tokens"]
                shares = {key.removeprefix("share_"): value for key, value in metrics.items()
                          if key.startswith("share_")}
                print(f"  step {step}{' (warm-up)' if step < args.warmup else ''}: {seconds:.2f} s, "
                      f"generated {metrics['generated_tokens'] / seconds:,.0f} tokens/s, "
                      f"prompt+response {tokens / seconds:,.0f} tokens/s; "
                      + ", ".join(f"{name} {share:.0%}" for name, share in shares.items()), flush=True)
                if step >= args.warmup:
                    timed.append((seconds, tokens, metrics["generated_tokens"], shares))
        finally:
            actor.rollouts.router.close()
            actor.rollouts.reward_source.close()
    seconds = statistics.median(t[0] for t in timed)
    per_second = statistics.median(t[1] / t[0] for t in timed)
    print(f"median step {seconds:.2f} s; generated tokens/s {statistics.median(t[2] / t[0] for t in timed):,.0f}; "
          "shares " + ", ".join(f"{name} {statistics.median(t[3][name] for t in timed):.0%}" for name in timed[0][3]))
    if device.type == "cuda":
        print(f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
    print(ratio_line("gpu_grpo_tokens_per_s_per_gpu" if device.type == "cuda" else "cpu_grpo_tokens_per_s",
                     per_second))


if __name__ == "__main__":
    main()
