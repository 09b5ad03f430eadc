"""Write the JSONL files of the demo's agentic task (long additions, a calculator the model may call).

    python examples/nlp/data/arithmetic/make_tool_data.py --out-dir data/long_addition --seed 0

A thin wrapper over aligner.demo.long_addition: SFT conversations (a calculator call and its answer copied, or an
answer in the head with the forgotten carries), RL prompts from train problems, held-out prompts.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from aligner.config import run_main
from aligner.data.jsonl import write_jsonl
from aligner.demo import long_addition


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True, help="directory for the JSONL files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--p-call", type=float, default=long_addition.DEFAULT_P_CALL,
                        help="probability that a demonstration calls the calculator")
    parser.add_argument("--p-forget-carry", type=float, default=long_addition.DEFAULT_P_FORGET_CARRY,
                        help="probability that an answer in the head forgets the carries")
    parser.add_argument("--num-sft", type=int, default=20000)
    parser.add_argument("--num-sft-validation", type=int, default=500)
    parser.add_argument("--num-heldout", type=int, default=500)
    parser.add_argument("--num-rl-prompts", type=int, default=5000)
    return parser.parse_args(argv)


def build_files(args: argparse.Namespace) -> dict[str, list[dict]]:
    seed, p_call, p_forget = args.seed, args.p_call, args.p_forget_carry
    return {
        "sft_train.jsonl": long_addition.sft_records(args.num_sft, seed, p_call, p_forget),
        "sft_validation.jsonl": long_addition.sft_records(args.num_sft_validation, seed, p_call, p_forget,
                                                          split="heldout"),
        "heldout_prompts.jsonl": long_addition.heldout_prompts(args.num_heldout, seed),
        "rl_prompts.jsonl": long_addition.rl_prompts(args.num_rl_prompts, seed),
    }


def summarize(name: str, records: list[dict]) -> str:
    """One line: count, and for demonstrations the share that call the tool and the share answered wrong."""
    line = f"{name}: {len(records)} records"
    if records and "messages" in records[0]:
        calls = sum(len(record["messages"]) > 2 for record in records) / len(records)
        prompts = [record["messages"][0]["content"] for record in records]
        answers = [record["messages"][-1]["content"] for record in records]
        wrong = 1.0 - long_addition.accuracy(prompts, answers)["all"]
        line += f", calculator called in {calls:.1%}, final answer wrong in {wrong:.1%}"
    return line


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for name, records in build_files(args).items():
        write_jsonl(args.out_dir / name, records)
        print(summarize(name, records))


if __name__ == "__main__":
    run_main(main)
