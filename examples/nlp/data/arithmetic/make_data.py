"""Write the demo task's JSONL files (SFT, held-out prompts, preferences, attributes, RL prompts).

    python examples/nlp/data/arithmetic/make_data.py --out-dir data/arithmetic --seed 0

A thin wrapper over aligner.demo.arithmetic: the task, its splits and the demonstrator's errors
are defined there. Validation files are drawn from held-out problems, never trained on.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from aligner.config import run_main
from aligner.data.jsonl import write_jsonl
from aligner.demo import arithmetic


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True, help="directory for the JSONL files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--p-forget-carry", type=float, default=arithmetic.DEFAULT_P_FORGET_CARRY,
                        help="probability that a carry demonstration forgets the carry")
    parser.add_argument("--num-sft", type=int, default=20000)
    parser.add_argument("--num-sft-validation", type=int, default=500)
    parser.add_argument("--num-sft-correct", type=int, default=5000,
                        help="demonstrations with every carry right (SPIN's ground truth)")
    parser.add_argument("--num-heldout", type=int, default=500, help="at most 2000")
    parser.add_argument("--num-preference", type=int, default=10000)
    parser.add_argument("--num-preference-validation", type=int, default=500)
    parser.add_argument("--num-attributes", type=int, default=10000)
    parser.add_argument("--num-attributes-validation", type=int, default=500)
    parser.add_argument("--num-rl-prompts", type=int, default=5000)
    return parser.parse_args(argv)


def build_files(args: argparse.Namespace) -> dict[str, list[dict]]:
    seed, p = args.seed, args.p_forget_carry
    return {
        "sft_train.jsonl": arithmetic.sft_records(args.num_sft, seed, p),
        "sft_validation.jsonl": arithmetic.sft_records(args.num_sft_validation, seed, p, split="heldout"),
        "heldout_prompts.jsonl": arithmetic.heldout_prompts(args.num_heldout, seed),
        "preference_train.jsonl": arithmetic.preference_records(args.num_preference, seed),
        "preference_validation.jsonl": arithmetic.preference_records(
            args.num_preference_validation, seed, split="heldout"
        ),
        "attributes_train.jsonl": arithmetic.attribute_records(args.num_attributes, seed),
        "attributes_validation.jsonl": arithmetic.attribute_records(
            args.num_attributes_validation, seed, split="heldout"
        ),
        "rl_prompts.jsonl": arithmetic.rl_prompts(args.num_rl_prompts, seed),
        "sft_correct_train.jsonl": arithmetic.correct_sft_records(args.num_sft_correct, seed),
    }


def summarize(name: str, records: list[dict]) -> str:
    """One line: count, share of carry problems, share of wrong responses where there are any."""
    if not records:
        return f"{name}: 0 records"
    first = records[0]
    if "input" in first:  # SFT demonstration
        pairs = [(r["input"], r["output"]) for r in records]
    elif "chosen" in first:  # preference pair
        pairs = [(r["prompt"], r["chosen"]) for r in records]
    elif "text" in first:  # attribute record: the prompt ends at "="
        pairs = [tuple(r["text"].split("=", 1)) for r in records]
        pairs = [(prompt + "=", response) for prompt, response in pairs]
    else:
        pairs = [(r["prompt"], r.get("answer")) for r in records]
    prompts = [prompt for prompt, _ in pairs]
    carry = sum(arithmetic.has_carry(*arithmetic.parse_prompt(p)) for p in prompts) / len(prompts)
    line = f"{name}: {len(records)} records, carry problems {carry:.1%}"
    if pairs[0][1] is not None:
        wrong = 1.0 - arithmetic.accuracy(prompts, [response for _, response in pairs])
        label = "chosen wrong" if "chosen" in first else "wrong"
        line += f", {label} {wrong:.1%}"
    if "chosen" in first:
        rejected_wrong = 1.0 - arithmetic.accuracy(prompts, [r["rejected"] for r in records])
        line += f", rejected wrong {rejected_wrong:.1%}"
    if "input" in first:
        carry_accuracy = arithmetic.accuracy_by_carry(prompts, [response for _, response in pairs])
        line += f" (on carry problems {1.0 - carry_accuracy['carry']:.1%})"
    return line


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for name, records in build_files(args).items():
        write_jsonl(args.out_dir / name, records)
        print(summarize(name, records))


if __name__ == "__main__":
    run_main(main)
