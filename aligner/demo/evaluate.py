"""Held-out accuracy of a checkpoint on the arithmetic demo task (greedy and sampled decoding)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from aligner.demo.arithmetic import accuracy_by_carry


def evaluate_arithmetic(model_chunks, tokenizer, prompts_path: str | Path, *, temperature: float = 0.0,
                        seed: int = 0, limit: Optional[int] = None, max_new_tokens: int = 6) -> dict:
    """Accuracy (overall, on carry and no-carry problems) of answers to the prompts in a JSONL file.

    Prompts are encoded exactly like the SFT `input` field: [bos] + prompt tokens.
    """
    from aligner.data.jsonl import read_jsonl, require_str
    from aligner.generation.reference import generate_full_forward

    records = [(line, record) for line, record in read_jsonl(prompts_path)][:limit]
    prompts = [require_str(record, "prompt", prompts_path, line) for line, record in records]
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    encoded = [bos + tokenizer.encode(prompt) for prompt in prompts]
    vocab_size = model_chunks[0].vocab_size if hasattr(model_chunks[0], "vocab_size") else None
    outputs = generate_full_forward(
        model_chunks, encoded, vocab_size=tokenizer.vocab_size if vocab_size is None else min(vocab_size, tokenizer.vocab_size),
        eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
    )
    responses = [tokenizer.decode([t for t in output if t != tokenizer.eos_id]) for output in outputs]
    result = accuracy_by_carry(prompts, responses)
    result["examples"] = [f"{p}{r}" for p, r in list(zip(prompts, responses))[:8]]
    return result


def evaluate_checkpoint(checkpoint_dir: str | Path, prompts_path: str | Path, *, temperature: float = 0.0,
                        seed: int = 0, limit: Optional[int] = None) -> dict:
    """Load an aligner checkpoint in this process (TP=PP=1) and evaluate it."""
    from aligner import checkpointing
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
    from aligner.runtime import distributed, seeds
    from aligner.tokenizer import Tokenizer

    distributed.initialize(distributed.ParallelConfig())
    seeds.set_seed(seed)
    model_cfg = GPTConfig.from_dict(checkpointing.read_meta(checkpoint_dir)["model"])
    model = build_gpt_model(model_cfg, transformer_config(model_cfg))
    checkpointing.load(checkpoint_dir, [model])
    tokenizer = Tokenizer(Path(checkpoint_dir) / checkpointing.TOKENIZER_DIR)
    return evaluate_arithmetic([model], tokenizer, prompts_path, temperature=temperature, seed=seed, limit=limit)


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="held-out accuracy of an aligner checkpoint on the arithmetic demo")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--prompts", required=True, help="JSONL with {'prompt': '12+7='} records")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--output", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = evaluate_checkpoint(args.checkpoint, args.prompts, temperature=args.temperature, limit=args.limit)
    mode = "greedy" if args.temperature == 0 else f"sampled T={args.temperature}"
    print(f"{args.checkpoint}: {mode} accuracy {result['all']:.1%} (carry {result['carry']:.1%}, "
          f"no carry {result['no_carry']:.1%}); e.g. {', '.join(result['examples'][:4])}")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
