"""Prefilling each distinct prompt once (its cache rows copied to the prompt's other samples) vs prefilling
every row, on the same engine weights, in one process.

Rollout-shaped work of GRPO/RLOO: --prompts distinct prompts x --samples samples each (adjacent, as the RL
actor lays out a group), all admitted at once (--samples x --prompts cache rows), sampled at temperature 1
for exactly --new-tokens tokens. Two continuous-batching engines differ only in `shared_prefill`; both
must give the same tokens (checked, and printed), and the two are timed in alternation (a burst of load
hits both sides of a pair). Printed: each side's whole generate call and its prefill alone (a one-token
call), and `ratio shared_prefill_vs_every_row VALUE` = median over pairs of (every-row time / shared time)
of the whole call.

    python benchmarks/shared_prefill.py [--model smollm2] [--prompts 8] [--samples 4] [--new-tokens 32]
        [--repeats 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

if not __package__:  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.continuous_batching import agreement, make_prompts, start  # noqa: E402
from benchmarks.machine import describe_peak_rss, load_average, timed  # noqa: E402
from benchmarks.peer.protocol import in_turn  # noqa: E402
from benchmarks.run_bench import ratio_line  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="an HF dir, a .gguf file, an aligner checkpoint or smollm2")
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts")
    parser.add_argument("--samples", type=int, default=4, help="samples of each prompt")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="timed pairs (medians reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (0: torch's choice)")
    args = parser.parse_args()
    from aligner.generation.engine import SamplingParams
    from aligner.generation.native import NativeEngine
    from aligner.runtime import distributed

    device, cfg, chunks, tokenizer = start(args.model, args.threads)
    prompts = [prompt for prompt in make_prompts(tokenizer, args.prompts) for _ in range(args.samples)]
    rows = len(prompts)
    engines = {shared: NativeEngine(chunks, cfg, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
                                    max_batch_size=rows, max_sequence_length=max(map(len, prompts)) + args.new_tokens,
                                    shared_prefill=shared)
               for shared in (False, True)}
    rollouts = {}

    def run(shared: bool, new_tokens: int):
        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=args.seed, fixed_length=True)

        def generate():
            rollouts[shared, new_tokens] = engines[shared].generate(prompts, sampling)
        return generate

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"shared prefill: {args.model}, {cfg.num_layers} layers x {cfg.hidden_size}; {where}; {args.prompts} "
          f"prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens x {args.samples} samples, "
          f"{args.new_tokens} new tokens at temperature 1; {args.repeats} alternating pairs after a warm-up call "
          f"each (load {load_average():.2f})", flush=True)
    for shared in (False, True):  # first-call costs (allocations, oneDNN primitives), untimed
        run(shared, args.new_tokens)()
    seconds = {}
    for new_tokens in (args.new_tokens, 1):
        pairs = []
        for repeat in range(args.repeats):
            times = {shared: timed(run(shared, new_tokens), device) for shared in in_turn((False, True), repeat)}
            pairs.append((times[False], times[True]))
        seconds[new_tokens] = pairs
    whole, prefill = seconds[args.new_tokens], seconds[1]
    same_rows, prefix_difference = agreement(rollouts[False, args.new_tokens], rollouts[True, args.new_tokens])
    print(f"tokens equal in {same_rows} of {rows} rows (a sampled row may part where a draw lies within rounding of "
          f"a CDF boundary); max |logprob difference| up to each row's first differing token {prefix_difference:.1e}")
    for name, pairs in (("whole call", whole), ("prefill + first token", prefill)):
        every, shared = statistics.median(e for e, _ in pairs), statistics.median(s for _, s in pairs)
        print(f"  {name:<22} every row {every:.3f} s, shared {shared:.3f} s (every / shared "
              f"{statistics.median(e / s for e, s in pairs):.2f}x)")
    print(f"load {load_average():.2f}; {describe_peak_rss()}")
    print(ratio_line("shared_prefill_vs_every_row", statistics.median(e / s for e, s in whole)))
    distributed.shutdown()


if __name__ == "__main__":
    main()
