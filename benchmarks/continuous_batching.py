"""Continuous batching vs the static-batch loop of the native engine, on the same engine weights, in one process.

Rollout-shaped work: more prompts than cache rows (--prompts over --max-batch-size), sampled at
temperature 1 with a stop token (default: the token of "." so a row ends with its first sentence),
so response lengths vary from row to row. The static-batch loop (continuous_batching=False) decodes
chunks of --max-batch-size rows until each chunk's longest row ends; continuous batching drops a row
the step it stops and admits the next waiting prompt into its cache row. Both must give the same
tokens (checked, and printed); the two are timed in alternation (a burst of load hits both sides of a
pair) and the ratio is the median over pairs of static-batch time / continuous time.

Also printed: the decode row-steps each loop computes (rows x steps summed over decode steps): the
work continuous batching saves, whatever the machine.

    python benchmarks/continuous_batching.py [--model smollm2] [--prompts 24] [--max-batch-size 8]
        [--new-tokens 48] [--stop "."] [--fixed-length] [--repeats 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

import torch

if not __package__:  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.generation import PROMPT_TEXT  # noqa: E402  (prompt windows of varied length over it)
from benchmarks.machine import describe_peak_rss, load_average, timed  # noqa: E402
from benchmarks.peer.protocol import in_turn  # noqa: E402
from benchmarks.run_bench import ratio_line  # noqa: E402


def load_model(spec: str):
    """(cfg, model chunks, tokenizer) of an aligner checkpoint resolved from `spec` (benchmarks/models.py)."""
    from aligner import checkpointing
    from aligner.models.gpt import GPTConfig, build_model_chunks
    from aligner.runtime.distributed import ParallelConfig
    from aligner.tokenizer import Tokenizer
    from benchmarks.models import resolve_model

    resolved = resolve_model(spec)
    cfg = GPTConfig.from_dict(checkpointing.read_meta(resolved.checkpoint_dir)["model"])
    chunks = build_model_chunks(cfg, ParallelConfig(), torch.float32)
    checkpointing.load(resolved.checkpoint_dir, chunks)
    return cfg, [chunk.eval() for chunk in chunks], Tokenizer(resolved.checkpoint_dir / checkpointing.TOKENIZER_DIR)


def start(model: str, threads: int):
    """(device, cfg, chunks, tokenizer): torch's threads set (0: its choice), one process group, the model loaded."""
    from aligner.runtime import distributed, seeds

    warnings.filterwarnings("ignore")
    if threads:
        torch.set_num_threads(threads)
    distributed.initialize(distributed.ParallelConfig())
    seeds.set_seed(0)
    return (distributed.device(), *load_model(model))


def make_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` windows of PROMPT_TEXT, 8 to 40 tokens long, from shifting starts."""
    text = tokenizer.encode(PROMPT_TEXT)
    prompts = []
    for row in range(count):
        length = 8 + (row * 13) % 33
        start = (row * 7) % (len(text) - length)
        prompts.append(text[start:start + length])
    return prompts


def decode_row_steps(lengths: list[int], rows: int) -> tuple[int, int]:
    """Decode rows computed by (static-batch loop, continuous batching) for these response lengths: the
    static loop runs each chunk's rows to its longest response; continuous batching only live rows."""
    static = sum(len(chunk) * (max(chunk) - 1) for chunk in (lengths[i:i + rows] for i in range(0, len(lengths), rows)))
    return static, sum(n - 1 for n in lengths)


def agreement(first, second) -> tuple[int, float]:
    """(rows whose tokens are equal, max |logprob difference| over each row's tokens up to its first difference)."""
    equal = first.response_tokens == second.response_tokens  # [rows, new_tokens]
    common = equal.long().cumprod(dim=1).bool()  # the equal prefix of each row
    difference = (first.logprobs - second.logprobs).abs().masked_fill(~common, 0.0)
    return int(equal.all(dim=1).sum()), float(difference.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="an HF dir, a .gguf file, an aligner checkpoint or smollm2")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-batch-size", type=int, default=8, help="the engine's cache rows")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--stop", default=".", help="text whose (single) token ends a response")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--fixed-length", action="store_true",
                        help="every row runs to --new-tokens (no early stops): what continuous batching costs when "
                        "it has nothing to refill")
    parser.add_argument("--repeats", type=int, default=3, help="timed pairs (medians reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (0: torch's choice)")
    args = parser.parse_args()
    from aligner.generation.engine import SamplingParams
    from aligner.generation.native import NativeEngine
    from aligner.runtime import distributed

    device, cfg, chunks, tokenizer = start(args.model, args.threads)
    stop = tokenizer.encode(args.stop)
    if len(stop) != 1:
        raise SystemExit(f"--stop {args.stop!r} is {len(stop)} tokens; give a text of one token")
    prompts = make_prompts(tokenizer, args.prompts)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=args.seed,
                              stop_token_ids=[stop[0], tokenizer.eos_id], fixed_length=args.fixed_length)
    max_len = max(len(p) for p in prompts) + args.new_tokens
    engines = {continuous: NativeEngine(chunks, cfg, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
                                        max_batch_size=args.max_batch_size, max_sequence_length=max_len,
                                        continuous_batching=continuous)
               for continuous in (False, True)}
    rollouts = {}

    def run(continuous: bool):
        def generate():
            rollouts[continuous] = engines[continuous].generate(prompts, sampling)
        return generate

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"continuous batching: {args.model}, {cfg.num_layers} layers x {cfg.hidden_size}; {where}; "
          f"{args.prompts} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.max_batch_size} cache rows, {'exactly' if args.fixed_length else 'up to'} {args.new_tokens} new "
          f"tokens at temperature 1, stop {args.stop!r} or eos; {args.repeats} alternating pairs after a warm-up "
          f"call each (load {load_average():.2f})", flush=True)
    for continuous in (False, True):  # first-call costs (allocations, oneDNN primitives), untimed
        run(continuous)()
    pairs = []
    for repeat in range(args.repeats):
        seconds = {continuous: timed(run(continuous), device) for continuous in in_turn((False, True), repeat)}
        pairs.append((seconds[False], seconds[True]))
        print(f"  pair {repeat + 1}: static-batch {seconds[False]:.2f} s, continuous {seconds[True]:.2f} s "
              f"(load {load_average():.2f})", flush=True)
    static_rollout, continuous_rollout = rollouts[False], rollouts[True]
    same_rows, prefix_difference = agreement(static_rollout, continuous_rollout)
    lengths = continuous_rollout.response_lengths.tolist()
    static_rows, continuous_rows = decode_row_steps(lengths, args.max_batch_size)
    print(f"response lengths: min {min(lengths)}, median {statistics.median(lengths):.0f}, max {max(lengths)}; "
          f"{int(continuous_rollout.ended_with_stop.sum())} of {len(lengths)} ended with a stop token")
    print(f"tokens equal in {same_rows} of {len(lengths)} rows (a sampled row may part where a draw lies within "
          f"rounding of a CDF boundary); max |logprob difference| up to each row's first differing token "
          f"{prefix_difference:.1e}")
    print(f"decode row-steps: static-batch {static_rows}, continuous {continuous_rows} "
          f"({static_rows / max(continuous_rows, 1):.2f}x fewer)")
    static_s = statistics.median(s for s, _ in pairs)
    continuous_s = statistics.median(c for _, c in pairs)
    tokens = sum(lengths)
    print(f"seconds (median): static-batch {static_s:.2f} ({tokens / static_s:.1f} tokens/s), "
          f"continuous {continuous_s:.2f} ({tokens / continuous_s:.1f} tokens/s)")
    print(describe_peak_rss())
    print(ratio_line("continuous_batching_vs_static", statistics.median(s / c for s, c in pairs)))
    distributed.shutdown()


if __name__ == "__main__":
    main()
