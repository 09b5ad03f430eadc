"""The tiny end-to-end alignment pipeline on CPU (`make demo`).

Stages, each the same command a user would run:
  1. data: arithmetic problems; the demonstrations systematically forget the carry
  2. tokenizer: a character-level HF tokenizer trained on that data
  3. init: a random-init model saved as a checkpoint ("before")
  4. SFT on the demonstrations, then held-out accuracy ("after")
  5. a reward model on preference pairs (right answer preferred), held-out pairwise accuracy
  6. a regression reward model on attribute labels (SteerLM), correlation with held-out labels
The SFT model learns the demonstrators' habit: right without a carry, mostly wrong with one.
That gap is what the alignment stages (PPO, DPO, ... on top of these reward models) have to close.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from aligner.checkpointing import latest_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
GPT_EXAMPLES = REPO_ROOT / "examples" / "nlp" / "gpt"
DATA_SCRIPTS = REPO_ROOT / "examples" / "nlp" / "data" / "arithmetic"

# The demo model and schedule (sized for ~2 minutes of SFT on 2 CPU cores).
SFT_OVERRIDES = [
    "data.max_seq_length=32",
    "data.split='100,0'",
    "trainer.max_steps=1000",
    "trainer.global_batch_size=128",
    "trainer.micro_batch_size=128",
    "trainer.val_check_interval=250",
    "optim.lr=1e-3",
    "optim.min_lr=1e-4",
    "optim.warmup_steps=20",
    "logging.log_interval=100",
]


# Reward models start from the SFT checkpoint; ~1000 steps is where they learn to check carries.
RM_OVERRIDES = [
    "data.max_seq_length=32",
    "trainer.max_steps=1000",
    "trainer.global_batch_size=64",
    "trainer.micro_batch_size=64",
    "trainer.val_check_interval=250",
    "optim.lr=1e-3",
    "optim.min_lr=1e-4",
    "optim.warmup_steps=20",
    "logging.log_interval=250",
    "checkpoint.resume=false",
]


def run(stage: str, command: list[str]) -> None:
    print(f"\n=== {stage}: {' '.join(map(str, command))}", flush=True)
    start = time.perf_counter()
    result = subprocess.run([str(c) for c in command], cwd=REPO_ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if result.returncode != 0:
        raise SystemExit(f"demo stage '{stage}' failed with exit code {result.returncode}")
    print(f"=== {stage} done in {time.perf_counter() - start:.0f} s", flush=True)


def evaluate(stage: str, checkpoint: Path, prompts: Path, output: Path, temperature: float = 0.0) -> dict:
    run(stage, [sys.executable, "-m", "aligner.demo.evaluate", "--checkpoint", checkpoint, "--prompts", prompts,
                "--temperature", str(temperature), "--output", output])
    return json.loads(output.read_text())


def evaluate_reward_model(stage: str, checkpoint: Path, flag: str, data_file: Path, output: Path) -> dict:
    run(stage, [sys.executable, "-m", "aligner.demo.evaluate", "--checkpoint", checkpoint, flag, data_file,
                "--output", output])
    return json.loads(output.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="results/demo")
    parser.add_argument("--sft-steps", type=int, default=None, help="override the SFT step count (quick runs)")
    parser.add_argument("--rm-steps", type=int, default=None, help="override the reward-model step counts (quick runs)")
    args = parser.parse_args()
    work = (REPO_ROOT / args.workdir).resolve()
    data, tokenizer = work / "data", work / "data" / "tokenizer"
    started = time.perf_counter()

    run("data", [sys.executable, DATA_SCRIPTS / "make_data.py", "--out-dir", data, "--seed", "0"])
    run("tokenizer", [sys.executable, DATA_SCRIPTS / "train_tokenizer.py", "--data-dir", data, "--out-dir", tokenizer])

    sft_common = [
        f"tokenizer.path={tokenizer}",
        f"data.train=[{{path: {data / 'sft_train.jsonl'}}}]",
        f"data.validation=[{{path: {data / 'sft_validation.jsonl'}}}]",
        *SFT_OVERRIDES,
    ]
    if args.sft_steps is not None:
        sft_common.append(f"trainer.max_steps={args.sft_steps}")
    run("init", [sys.executable, GPT_EXAMPLES / "train_gpt_sft.py", *sft_common, "trainer.max_steps=0",
                 f"checkpoint.save_dir={work / 'init'}", f"logging.log_dir={work / 'init'}", "checkpoint.resume=false"])
    init_checkpoint = work / "init" / "step_00000000"
    heldout = data / "heldout_prompts.jsonl"
    before = evaluate("evaluate init", init_checkpoint, heldout, work / "eval_init.json")

    sft_dir = work / "sft"
    run("sft", [sys.executable, GPT_EXAMPLES / "train_gpt_sft.py", *sft_common, f"model.init_from={init_checkpoint}",
                f"checkpoint.save_dir={sft_dir / 'checkpoints'}", f"logging.log_dir={sft_dir}", "checkpoint.resume=false"])
    sft_checkpoint = latest_checkpoint(sft_dir / "checkpoints")
    after = evaluate("evaluate sft (greedy)", sft_checkpoint, heldout, work / "eval_sft.json")
    sampled = evaluate("evaluate sft (sampled)", sft_checkpoint, heldout, work / "eval_sft_sampled.json", temperature=1.0)

    rm_steps = [] if args.rm_steps is None else [f"trainer.max_steps={args.rm_steps}"]
    rm_dir = work / "reward_model"
    run("reward model", [sys.executable, GPT_EXAMPLES / "train_reward_model.py", f"model.init_from={sft_checkpoint}",
                         f"data.train=[{{path: {data / 'preference_train.jsonl'}}}]",
                         f"data.validation=[{{path: {data / 'preference_validation.jsonl'}}}]", *RM_OVERRIDES, *rm_steps,
                         f"checkpoint.save_dir={rm_dir / 'checkpoints'}", f"logging.log_dir={rm_dir}"])
    rm_result = evaluate_reward_model("evaluate reward model", latest_checkpoint(rm_dir / "checkpoints"),
                                      "--comparisons", data / "preference_validation.jsonl", work / "eval_rm.json")
    steerlm_rm_dir = work / "attribute_reward_model"
    run("attribute reward model", [
        sys.executable, GPT_EXAMPLES / "train_reward_model.py", f"model.init_from={sft_checkpoint}",
        "reward.type=regression", "reward.attributes=[correctness]", "reward.normalize=false",
        f"data.train=[{{path: {data / 'attributes_train.jsonl'}}}]",
        f"data.validation=[{{path: {data / 'attributes_validation.jsonl'}}}]", *RM_OVERRIDES, *rm_steps,
        f"checkpoint.save_dir={steerlm_rm_dir / 'checkpoints'}", f"logging.log_dir={steerlm_rm_dir}"])
    attribute_result = evaluate_reward_model(
        "evaluate attribute reward model", latest_checkpoint(steerlm_rm_dir / "checkpoints"),
        "--attributes", data / "attributes_validation.jsonl", work / "eval_attribute_rm.json")

    losses = [json.loads(line) for line in (sft_dir / "metrics.jsonl").read_text().splitlines()]
    train_losses = [row["loss"] for row in losses if row["split"] == "train"]
    print("\n=== demo summary (held-out problems, never trained on)")
    print(f"SFT loss: {train_losses[0]:.3f} at step 1 -> {train_losses[-1]:.3f} at step {len(train_losses)}")
    print(f"{'model':<22}{'accuracy':>10}{'carry':>10}{'no carry':>10}")
    for name, result in (("random init (greedy)", before), ("SFT (greedy)", after), ("SFT (sampled, T=1)", sampled)):
        print(f"{name:<22}{result['all']:>10.1%}{result['carry']:>10.1%}{result['no_carry']:>10.1%}")
    print(f"reward model: held-out pairwise accuracy {rm_result['accuracy']:.1%} ({rm_result['pairs']} pairs)")
    print("attribute reward model: Pearson correlation with held-out labels "
          + ", ".join(f"{name} {value:.3f}" for name, value in attribute_result.items()))
    print(f"total time {time.perf_counter() - started:.0f} s; artefacts in {work}")


if __name__ == "__main__":
    main()
