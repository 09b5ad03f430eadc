"""Evaluate a chat checkpoint on the instruction-following task (`make demo-real`).

    python -m aligner.demo.instruction_eval --checkpoint CKPT --heldout heldout.jsonl --general general.jsonl \
        --output eval.json [--max-new-tokens 64] [--kl-samples 4]

- held-out prompts answered greedily (chat batch mode, the user's path): the satisfaction rates of
  `aligner.demo.instructions.satisfaction` and the mean response length in words;
- the general prompts answered greedily (shown before/after so a person can see the model still talks);
- the KL to the base model (`--base`) on the general prompts: `kl_samples` answers per prompt sampled from
  the checkpoint (temperature 1), each scored sum_t log pi(y_t) - log pi_base(y_t) (an unbiased estimate of
  KL(pi || pi_base) per answer), averaged;
- per general prompt, how many of `fault_samples` answers sampled at FAULT_TEMPERATURE have a fault
  (`instructions.general_answer_faults`): the greedy answer alone can sit on a near-tie (SmolLM2's first token
  to "What is the capital of France?": "The" 0.15, "L" 0.14), so a model is judged against the base on rates
  (the sampled answers in general_samples.jsonl beside the result).
"""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch

from aligner import checkpointing
from aligner.config import run_main
from aligner.data.conversation import ChatEncoder
from aligner.data.jsonl import read_jsonl
from aligner.demo.instructions import general_answer_faults, satisfaction
from aligner.generation.chat import (
    ChatConfig,
    ChatSamplingConfig,
    answer_file,
    encode_record,
    generate_tokens,
    load_chat_model,
    response_text,
)
from aligner.generation.engine import SamplingParams
from aligner.models.forward import forward_logits
from aligner.models.gpt import GPTConfig, build_model_chunks
from aligner.models.lora import load_merged
from aligner.runtime import distributed


def _answers(model, cfg, prompts_file: Path, output_file: Path) -> list[dict]:
    import dataclasses

    answer_file(model, dataclasses.replace(cfg, prompts_file=str(prompts_file), output_file=str(output_file)))
    return [record for _, record in read_jsonl(output_file)]


def _kl_to_base(model, base_chunks, prompts: list[list[int]], samples: int, max_new_tokens: int,
                seed: int) -> float:
    """Mean over answers sampled from `model` of sum_t log pi(y_t | .) - log pi_base(y_t | .)."""
    import torch.nn.functional as F

    repeated = [prompt for prompt in prompts for _ in range(samples)]
    rollout = model.engine.generate(repeated, SamplingParams(
        max_new_tokens=max_new_tokens, temperature=1.0, greedy=False, seed=seed, stop_token_ids=model.stop_token_ids))
    estimates = []
    for row, prompt in enumerate(repeated):
        length = int(rollout.response_lengths[row])
        if length == 0:
            continue
        tokens = torch.tensor([prompt + rollout.response_tokens[row, :length].tolist()])
        targets = tokens[0, len(prompt):]
        logits = forward_logits(base_chunks, tokens[:, :-1], model.vocab_size)[0, len(prompt) - 1:]
        base = F.log_softmax(logits.double(), dim=-1).gather(-1, targets[:, None])[:, 0]
        estimates.append(float(rollout.logprobs[row, :length].double().sum() - base.sum()))
    return sum(estimates) / len(estimates) if estimates else 0.0


FAULT_TEMPERATURE = 0.7  # the demo's RL and DPO sampling temperature


def _general_fault_counts(model, prompts: list[list[int]], texts: list[str], samples: int, max_new_tokens: int,
                          seed: int, answers_file: Path) -> list[dict]:
    """Per general prompt {"prompt", "faulty", "samples"}: how many of `samples` answers sampled at
    FAULT_TEMPERATURE have a fault; the answers go to `answers_file` ({"prompt", "response", "faults"} rows)."""
    tokens = generate_tokens(model, [prompt for prompt in prompts for _ in range(samples)], SamplingParams(
        max_new_tokens=max_new_tokens, temperature=FAULT_TEMPERATURE, greedy=False, seed=seed,
        stop_token_ids=model.stop_token_ids))
    counts, lines = [], []
    for index, text in enumerate(texts):
        answers = [response_text(model, row) for row in tokens[index * samples:(index + 1) * samples]]
        faults = [general_answer_faults(text, answer) for answer in answers]
        counts.append({"prompt": text, "faulty": sum(map(bool, faults)), "samples": samples})
        lines += [json.dumps({"prompt": text, "response": answer, "faults": found}) + "\n"
                  for answer, found in zip(answers, faults)]
    answers_file.write_text("".join(lines))
    return counts


def _load_base(base: str | Path) -> list:
    model_cfg = GPTConfig.from_dict(checkpointing.read_meta(base)["model"])
    chunks = build_model_chunks(model_cfg, distributed.ParallelConfig(), distributed.resolve_precision("auto"))
    load_merged(base, chunks)
    for chunk in chunks:
        chunk.eval()
    return chunks


def evaluate(checkpoint: str | Path, heldout: str | Path, general: str | Path, output_dir: str | Path, *,
             base: str | Path | None = None, max_new_tokens: int = 64, batch_size: int = 32, kl_samples: int = 4,
             fault_samples: int = 64, seed: int = 0) -> dict:
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    # (batch mode: prompts_file set when the engine is built, which sizes its cache for batch_size rows)
    cfg = ChatConfig(init_from=str(checkpoint), batch_size=batch_size, prompts_file=str(heldout),
                     output_file=str(output_dir / "heldout_answers.jsonl"),
                     sampling=ChatSamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0, seed=seed))
    with contextlib.ExitStack() as stack:
        model = load_chat_model(cfg, stack)
        try:
            answered = _answers(model, cfg, Path(heldout), output_dir / "heldout_answers.jsonl")
            general_answers = _answers(model, cfg, Path(general), output_dir / "general_answers.jsonl")
            encoder = ChatEncoder(model.tokenizer, cfg.chat_template)
            records = list(read_jsonl(general))
            prompts = [encode_record(model, encoder, record, str(general), line) for line, record in records]
            texts = [row["prompt"][-1]["content"] if isinstance(row["prompt"], list) else row["prompt"]
                     for row in general_answers]
            fault_counts = _general_fault_counts(model, prompts, texts, fault_samples, max_new_tokens, seed,
                                                 output_dir / "general_samples.jsonl")
            kl = None
            if base is not None:
                kl = _kl_to_base(model, _load_base(base), prompts, kl_samples, max_new_tokens, seed)
        finally:
            distributed.shutdown()
    responses = [row["response"] or "" for row in answered]
    result = satisfaction([row["prompt"] for row in answered], responses)
    result.update(checkpoint=str(checkpoint), prompts=len(answered),
                  mean_words=sum(len(text.split()) for text in responses) / len(responses),
                  kl_to_base=kl, general=[{"prompt": row["prompt"], "response": row["response"]}
                                          for row in general_answers], general_fault_counts=fault_counts)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--heldout", required=True, help="JSONL of held-out prompts")
    parser.add_argument("--general", required=True, help="JSONL of general prompts")
    parser.add_argument("--output", required=True, help="the result JSON; answers go beside it")
    parser.add_argument("--base", default=None, help="the base model the KL is measured to (none: no KL)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--kl-samples", type=int, default=4)
    parser.add_argument("--fault-samples", type=int, default=64,
                        help="answers sampled per general prompt for its fault rate")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    output = Path(args.output)
    result = evaluate(args.checkpoint, args.heldout, args.general, output.with_suffix(""), base=args.base,
                      max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, kl_samples=args.kl_samples,
                      fault_samples=args.fault_samples, seed=args.seed)
    output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.checkpoint}: held-out satisfaction {100 * result['prompt_level']:.1f} % of prompts, "
          f"{100 * result['constraint_level']:.1f} % of constraints ({result['prompts']} prompts); "
          f"{result['mean_words']:.1f} words per answer"
          + ("" if result["kl_to_base"] is None else f"; KL to the base {round(result['kl_to_base'], 3) + 0.0:.3f}"))


if __name__ == "__main__":
    run_main(main)
