"""Held-out accuracy of a checkpoint on the arithmetic demo task (greedy and sampled decoding)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from aligner import checkpointing
from aligner.checkpointing import CheckpointError
from aligner.config import run_main
from aligner.data.jsonl import read_jsonl, require_str
from aligner.data.reward import ComparisonDataset, RegressionDataset
from aligner.data.steerlm import condition_prompt, parse_requested_values, steering_for_checkpoint
from aligner.demo.arithmetic import accuracy_by_carry
from aligner.generation.reference import generate_full_forward
from aligner.models import lora
from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
from aligner.models.reward import load_reward_model
from aligner.runtime import distributed, seeds
from aligner.tokenizer import Tokenizer


def evaluate_arithmetic(model_chunks, tokenizer, prompts_path: str | Path, *, temperature: float = 0.0,
                        seed: int = 0, limit: Optional[int] = None, max_new_tokens: int = 6,
                        steer: Optional[dict] = None, steerlm=None) -> dict:
    """Accuracy (overall, on carry and no-carry problems) of answers to the prompts in a JSONL file.

    Prompts are encoded exactly like the SFT `input` field: [bos] + prompt tokens. With `steer`
    (attribute values, e.g. {"correctness": 4}) and `steerlm` (the checkpoint's SteerLMConfig),
    the prompt asks for those values the way attribute-conditioned SFT rendered them.
    """
    records = [(line, record) for line, record in read_jsonl(prompts_path)][:limit]
    prompts = [require_str(record, "prompt", prompts_path, line) for line, record in records]
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    model_prompts = prompts if steer is None else [condition_prompt(prompt, steer, steerlm) for prompt in prompts]
    encoded = [bos + tokenizer.encode(prompt) for prompt in model_prompts]
    vocab_size = model_chunks[0].vocab_size if hasattr(model_chunks[0], "vocab_size") else None
    outputs = generate_full_forward(
        model_chunks, encoded,
        vocab_size=tokenizer.vocab_size if vocab_size is None else min(vocab_size, tokenizer.vocab_size),
        eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, max_new_tokens=max_new_tokens, temperature=temperature,
        seed=seed,
    )
    responses = [tokenizer.decode([t for t in output if t != tokenizer.eos_id]) for output in outputs]
    result = accuracy_by_carry(prompts, responses)
    result["examples"] = [f"{p}{r}" for p, r in list(zip(prompts, responses))[:8]]
    return result


def evaluate_checkpoint(checkpoint_dir: str | Path, prompts_path: str | Path, *, temperature: float = 0.0,
                        seed: int = 0, limit: Optional[int] = None, steer: Optional[dict] = None) -> dict:
    """Load an aligner checkpoint in this process (TP=PP=1) and evaluate it.

    steer: attribute values to ask a SteerLM (attribute-conditioned) checkpoint for.
    """
    steerlm = steering_for_checkpoint(checkpoint_dir, steer)  # before loading: a mismatch fails fast
    distributed.initialize(distributed.ParallelConfig())
    seeds.set_seed(seed)
    model_cfg = GPTConfig.from_dict(checkpointing.read_meta(checkpoint_dir)["model"])
    model = build_gpt_model(model_cfg, transformer_config(model_cfg))
    lora.load_for_inference(checkpoint_dir, [model])  # an adapter checkpoint: onto its base
    tokenizer = Tokenizer(Path(checkpoint_dir) / checkpointing.TOKENIZER_DIR)
    return evaluate_arithmetic([model], tokenizer, prompts_path, temperature=temperature, seed=seed, limit=limit,
                               steer=steer, steerlm=steerlm)


def _rewards(loaded, sequences: list, batch_size: int = 256) -> torch.Tensor:
    """Raw rewards [N, A] of token sequences, in batches."""
    out = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        lengths = torch.tensor([len(seq) for seq in chunk])
        tokens = torch.full((len(chunk), int(lengths.max())), loaded.tokenizer.pad_id, dtype=torch.long)
        for row, seq in enumerate(chunk):
            tokens[row, : len(seq)] = seq
        out.append(loaded.inference.infer(tokens, lengths, normalize=False))
    return torch.cat(out)


def reward_model_accuracy(checkpoint_dir: str | Path, comparisons_path: str | Path, max_seq_length: int = 512) -> dict:
    """Share of held-out pairs where the reward model scores the chosen response higher."""
    distributed.initialize(distributed.ParallelConfig())
    loaded = load_reward_model(checkpoint_dir, micro_batch_size=64)
    pairs = ComparisonDataset(comparisons_path, loaded.tokenizer, max_seq_length)
    chosen = _rewards(loaded, [pairs[i]["chosen"] for i in range(len(pairs))])[:, 0]
    rejected = _rewards(loaded, [pairs[i]["rejected"] for i in range(len(pairs))])[:, 0]
    return {"accuracy": float((chosen > rejected).float().mean()), "pairs": len(pairs),
            "margin": float((chosen - rejected).mean())}


def reward_model_correlation(checkpoint_dir: str | Path, attributes_path: str | Path,
                             max_seq_length: int = 512) -> dict:
    """Pearson correlation between predicted and labelled attribute values, per attribute."""
    distributed.initialize(distributed.ParallelConfig())
    loaded = load_reward_model(checkpoint_dir, micro_batch_size=64)
    data = RegressionDataset(attributes_path, loaded.tokenizer, max_seq_length, list(loaded.info.attributes))
    predictions = _rewards(loaded, [data[i]["tokens"] for i in range(len(data))]).double()
    labels = torch.stack([data[i]["labels"] for i in range(len(data))]).double()
    masks = torch.stack([data[i]["label_mask"] for i in range(len(data))]).bool()
    result = {}
    for index, name in enumerate(loaded.info.attributes):
        x, y = predictions[masks[:, index], index], labels[masks[:, index], index]
        result[name] = float(torch.corrcoef(torch.stack([x, y]))[0, 1])
    return result


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="held-out quality of an aligner checkpoint on the arithmetic demo")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--prompts", help="policy: JSONL with {'prompt': '12+7='} records")
    parser.add_argument("--comparisons", help="binary reward model: JSONL {prompt, chosen, rejected} pairs")
    parser.add_argument("--attributes", help="regression reward model: JSONL {text, label} records")
    parser.add_argument("--steer", default=None, metavar="NAME=VALUE,...",
                        help="policy trained with SteerLM attribute conditioning: ask for these attribute values, "
                             "e.g. correctness=4")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--output", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.comparisons or args.attributes:
        if args.comparisons:
            result = reward_model_accuracy(args.checkpoint, args.comparisons)
            print(f"{args.checkpoint}: held-out pairwise accuracy {result['accuracy']:.1%} over {result['pairs']} "
                  f"pairs (mean margin {result['margin']:.3f})")
        else:
            result = reward_model_correlation(args.checkpoint, args.attributes)
            print(f"{args.checkpoint}: Pearson correlation with labels: "
                  + ", ".join(f"{name} {value:.3f}" for name, value in result.items()))
        if args.output:
            Path(args.output).write_text(json.dumps(result, indent=2))
        return
    if not args.prompts:
        parser.error("give --prompts (policy), --comparisons or --attributes (reward models)")
    steer = None
    if args.steer is not None:
        try:
            steer = parse_requested_values(args.steer)
            steering_for_checkpoint(args.checkpoint, steer)  # the checkpoint was conditioned on these attributes
        except (ValueError, CheckpointError) as error:
            parser.error(f"--steer: {error}")
    result = evaluate_checkpoint(args.checkpoint, args.prompts, temperature=args.temperature, limit=args.limit,
                                 steer=steer)
    mode = "greedy" if args.temperature == 0 else f"sampled T={args.temperature}"
    if steer is not None:
        mode += " asking for " + ",".join(f"{name}={value}" for name, value in steer.items())
    print(f"{args.checkpoint}: {mode} accuracy {result['all']:.1%} (carry {result['carry']:.1%}, "
          f"no carry {result['no_carry']:.1%}); e.g. {', '.join(result['examples'][:4])}")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":  # checkpoint loading (dist_checkpointing) spawns processes that re-import __main__
    run_main(main)
