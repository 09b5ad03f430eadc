"""Held-out accuracy on the demo's long additions, with the calculator (greedy episodes) and without (one turn).

    python -m aligner.demo.tool_eval --checkpoint CKPT --prompts heldout_prompts.jsonl --tools --output eval.json

With `--tools` every problem is an episode as the RL actor runs it with `rollout.tools=[calculator]` and
`rollout.tool_call_format=plain`: the calculator (aligner/agents/builtin.py) in sandbox workers, the chat template
rendered turn by turn (`ChatRenderer`), a reply with a call answered by the tool, a reply without one the final
answer. The result has the accuracy, tool calls per episode (by outcome) and the fraction of episodes ending in
each status. Without `--tools` each problem is one greedy reply to the same rendered prompt; a reply that is a call
is left as the answer (it scores 0), and the share of such replies is reported as `call_replies`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

from aligner import checkpointing
from aligner.agents.builtin import BUILTIN
from aligner.agents.environment import ToolEnvironment, sandboxed_tools
from aligner.agents.renderer import ChatRenderer
from aligner.agents.rollout import EpisodeLimits, EpisodeRunner
from aligner.agents.tool_calls import TOOL_CALL_FORMATS
from aligner.config import run_main
from aligner.data.jsonl import read_jsonl, require_str
from aligner.demo.long_addition import accuracy
from aligner.generation.engine import GenerationEngine, SamplingParams
from aligner.generation.native.engine import NativeEngine
from aligner.models import lora
from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
from aligner.runtime import distributed, seeds
from aligner.runtime.sandbox import SandboxLimits, SandboxPool
from aligner.tokenizer import Tokenizer

CALL_FORMAT = "plain"  # the toy model's tool-call format (lines `CALL name {json}`)
# As the demo's RL runs: a call and its end are 44 tokens; an episode (prompt, call, answer, final answer) ~70.
MAX_NEW_TOKENS, MAX_EPISODE_TOKENS = 48, 128


def evaluate_long_addition(engine: GenerationEngine, tokenizer: Tokenizer, prompts_path: str | Path, *,
                           tools: bool, limit: Optional[int] = None, max_new_tokens: int = MAX_NEW_TOKENS,
                           max_turns: int = 3, max_episode_tokens: int = MAX_EPISODE_TOKENS,
                           sandbox_workers: int = 4) -> dict:
    """Greedy accuracy (overall, with and without a carry) on the prompts of a JSONL file, with the calculator
    as an episode's tool or in one turn; see the module docstring for the other keys."""
    prompts = [require_str(record, "prompt", prompts_path, line) for line, record in read_jsonl(prompts_path)][:limit]
    sampling = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    if tools:
        answers, metrics = _episodes(engine, tokenizer, prompts, sampling, max_turns, max_episode_tokens,
                                     sandbox_workers)
    else:
        encoded = [tokenizer.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)[0]
                   for prompt in prompts]
        rollout = engine.generate(encoded, sampling)
        answers = [_text(tokenizer, rollout.response_tokens[row, : int(rollout.response_lengths[row])].tolist())
                   for row in range(len(prompts))]
        calls = sum(TOOL_CALL_FORMATS[CALL_FORMAT].parse(answer).has_calls for answer in answers)
        metrics = {"call_replies": calls / len(prompts)}
    result = accuracy(prompts, answers)
    result.update(metrics)
    result["examples"] = [f"{prompt}{answer}" for prompt, answer in list(zip(prompts, answers))[:8]]
    return result


def _text(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode([token for token in ids if token != tokenizer.eos_id])


def _episodes(engine, tokenizer, prompts, sampling, max_turns, max_episode_tokens, workers) -> tuple[list, dict]:
    """The final answers of greedy episodes with the calculator, and the episodes' metrics."""
    with SandboxPool(workers, SandboxLimits(timeout_s=10.0)) as pool:
        calculator = sandboxed_tools(pool, [BUILTIN["calculator"]])
        runner = EpisodeRunner(engine, lambda schemas: ChatRenderer(tokenizer, tools=schemas),
                               lambda: ToolEnvironment(pool, calculator, call_format=CALL_FORMAT), sampling,
                               EpisodeLimits(max_turns=max_turns, max_episode_tokens=max_episode_tokens,
                                             on_failure="zero_reward"),
                               parallel_environments=workers)
        batch = runner.run([{"prompt": prompt} for prompt in prompts],
                           [f"prompt {index + 1}" for index in range(len(prompts))])
    answers = [""] * len(prompts)
    for index, episode in zip(batch.indices, batch.episodes):
        model_turns = [segment for segment in episode.segments if segment.kind == "model"]
        answers[index] = _text(tokenizer, list(model_turns[-1].tokens)) if model_turns else ""
    metrics = {key.removeprefix("episodes/"): value for key, value in batch.metrics().items()}
    return answers, metrics


def evaluate_checkpoint(checkpoint_dir: str | Path, prompts_path: str | Path, *, tools: bool,
                        limit: Optional[int] = None) -> dict:
    """Load an aligner checkpoint in this process (TP=PP=1) and evaluate it."""
    distributed.initialize(distributed.ParallelConfig())
    seeds.set_seed(0)
    model_cfg = GPTConfig.from_dict(checkpointing.read_meta(checkpoint_dir)["model"])
    model = build_gpt_model(model_cfg, transformer_config(model_cfg))
    lora.load_for_inference(checkpoint_dir, [model])
    model.eval()
    tokenizer = Tokenizer(Path(checkpoint_dir) / checkpointing.TOKENIZER_DIR)
    engine = NativeEngine([model], model_cfg, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id, max_batch_size=512,
                          max_sequence_length=MAX_EPISODE_TOKENS, decode=tokenizer.decode)
    return evaluate_long_addition(engine, tokenizer, prompts_path, tools=tools, limit=limit)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--prompts", required=True, help="JSONL with {'prompt': '1234+567='} records")
    parser.add_argument("--tools", action="store_true", help="episodes with the calculator (else one turn)")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--output", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = evaluate_checkpoint(args.checkpoint, args.prompts, tools=args.tools, limit=args.limit)
    mode = "episodes with the calculator" if args.tools else "one turn"
    line = f"{args.checkpoint}: greedy, {mode}: accuracy {result['all']:.1%}"
    if args.tools:
        line += (f", tool calls per episode {result['tool_calls']:.2f}, done {result['done']:.1%}, "
                 f"max_turns {result['max_turns']:.1%}, truncated {result['truncated']:.1%}")
    else:
        line += f", replies that are a call {result['call_replies']:.1%}"
    print(f"{line}; e.g. {', '.join(result['examples'][:3])}")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":  # checkpoint loading (dist_checkpointing) spawns processes that re-import __main__
    run_main(main)
