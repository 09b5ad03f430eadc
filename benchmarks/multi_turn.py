"""Multi-turn episodes on kept KV cache rows (`NativeEngine.generate_turns`) vs generating every turn's whole
history again (the `GenerationEngine` protocol's default, on the same engine), in one process.

Agent-shaped work on a random toy model (--layers x --hidden, as generation.py's toy model): --episodes
episodes of T model turns each, for each T of --turns, a first prompt of --prompt-tokens tokens (a system
prompt and tool schemas), every turn exactly --new-tokens tokens (sampled at temperature 1, fixed length: equal
work on both sides) and a scripted environment that appends the same --observation-tokens tokens (a tool's
output) after every turn but the last. The re-prefill side runs turn by turn: each turn prefills every
episode's whole history (one generate_stream request per episode, continuous batching within the turn); the
kept side prefills the first prompts once and then, per turn, only the reply's last token and the
observation. Both must give the same tokens (checked, printed); the two are timed in alternation (a burst of
load hits both sides of a pair) and `ratio multi_turn_kept_cache_vs_reprefill_T_turns` is the median over
pairs of re-prefill time / kept-cache time.

    python benchmarks/multi_turn.py [--episodes 8] [--turns 4,8] [--prompt-tokens 256] [--observation-tokens 64]
        [--new-tokens 32] [--repeats 3] [--threads 1]
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

from benchmarks.machine import cpu_model, describe_peak_rss, load_average, timed  # noqa: E402
from benchmarks.peer.protocol import in_turn  # noqa: E402
from benchmarks.run_bench import ratio_line  # noqa: E402


def prefilled_tokens(args, turns: int) -> tuple[int, int]:
    """Tokens each side prefills: (kept cache, re-prefill)."""
    turn_tokens = args.new_tokens + args.observation_tokens
    kept = args.episodes * (args.prompt_tokens + (turns - 1) * (1 + args.observation_tokens))
    again = args.episodes * sum(args.prompt_tokens + turn * turn_tokens for turn in range(turns))
    return kept, again


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", default="4,8", help="model turns of every episode, one comparison per value")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="first prompt of each episode")
    parser.add_argument("--observation-tokens", type=int, default=64, help="appended after each turn but the last")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens of every turn")
    parser.add_argument("--max-batch-size", type=int, default=8, help="the engine's cache rows")
    parser.add_argument("--layers", type=int, default=4, help="toy model")
    parser.add_argument("--hidden", type=int, default=128, help="toy model")
    parser.add_argument("--heads", type=int, default=4, help="toy model")
    parser.add_argument("--vocab", type=int, default=256, help="toy model")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="timed pairs (medians reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's choice)")
    args = parser.parse_args()
    turn_counts = [int(value) for value in args.turns.split(",")]
    from aligner.generation.engine import GenerationEngine, SamplingParams
    from aligner.generation.native import NativeEngine
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
    from aligner.runtime import distributed, seeds

    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    distributed.initialize(distributed.ParallelConfig())
    seeds.set_seed(0)
    longest = args.prompt_tokens + (max(turn_counts) - 1) * (args.new_tokens + args.observation_tokens)
    cfg = GPTConfig.llama(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                          vocab_size=args.vocab, max_position_embeddings=longest + args.new_tokens)
    model = build_gpt_model(cfg, transformer_config(cfg)).eval()
    engine = NativeEngine([model], cfg, pad_id=0, eos_id=1, max_batch_size=args.max_batch_size,
                          max_sequence_length=longest + args.new_tokens)
    generator = torch.Generator().manual_seed(args.seed)
    first_prompts = [torch.randint(2, args.vocab, (args.prompt_tokens,), generator=generator).tolist()
                     for _ in range(args.episodes)]
    observation = torch.randint(2, args.vocab, (args.observation_tokens,), generator=generator).tolist()
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=args.seed, fixed_length=True)
    replies = {}

    def run(kept: bool, turns: int):
        def on_turn(episode, ids, logprobs, stopped):
            episode_replies = replies[kept].setdefault(episode, [])
            episode_replies.append(ids)
            return observation if len(episode_replies) < turns else None

        def play():
            replies[kept] = {}
            if kept:
                engine.generate_turns(first_prompts, sampling, on_turn, longest)
            else:  # the protocol's default on the same engine: every turn's whole history prefilled again
                GenerationEngine.generate_turns(engine, first_prompts, sampling, on_turn, longest)
        return play

    print(f"multi-turn: random toy model, {cfg.num_layers} layers x {cfg.hidden_size}; CPU {cpu_model()}, "
          f"{torch.get_num_threads()} threads; {args.episodes} episodes, first prompt {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens a turn, {args.observation_tokens} observation tokens; {args.repeats} "
          f"alternating pairs after a warm-up call each (load {load_average():.2f})", flush=True)
    ratios = []
    for turns in turn_counts:
        for kept in (False, True):  # first-call costs (allocations, oneDNN primitives), untimed
            run(kept, turns)()
        same = sum(replies[True][episode] == replies[False][episode] for episode in range(args.episodes))
        pairs = []
        for repeat in range(args.repeats):
            times = {kept: timed(run(kept, turns)) for kept in in_turn((False, True), repeat)}
            pairs.append((times[False], times[True]))
        again, kept = statistics.median(a for a, _ in pairs), statistics.median(k for _, k in pairs)
        ratio = statistics.median(a / k for a, k in pairs)
        kept_tokens, again_tokens = prefilled_tokens(args, turns)
        print(f"  {turns} turns: prefilled tokens kept cache {kept_tokens}, re-prefill {again_tokens}; tokens equal "
              f"in {same} of {args.episodes} episodes; re-prefill {again:.3f} s, kept cache {kept:.3f} s "
              f"(re-prefill / kept {ratio:.2f}x)", flush=True)
        ratios.append((turns, ratio))
    print(f"load {load_average():.2f}; {describe_peak_rss()}")
    for turns, ratio in ratios:
        print(ratio_line(f"multi_turn_kept_cache_vs_reprefill_{turns}_turns", ratio))
    distributed.shutdown()


if __name__ == "__main__":
    main()
