"""Peak RSS and wall time of the entry points on a real model (SmolLM2-135M-Instruct), one process each.

    .venv/bin/python benchmarks/real_model_memory.py --hf-dir HF_MODEL_DIR [--code-root DIR] \
        [--stages import,chat,sft,dpo,rl] [--work DIR] [--threads 2] [--dpo-pairs 2] [--dpo-seq-length 256] \
        [--dpo-steps 3] [--rl-steps 2]

Stages, each a fresh process of the code under --code-root (default: this checkout; another
checkout, e.g. an older commit, gives the "before" numbers with the same commands):
- import: `python -m aligner.hf import` of the HF directory (fp32), the checkpoint the others use;
- chat:   batch mode, 16 templated prompts in one generate call, 64 new tokens, greedy;
- sft:    3 steps, micro batch 4 = global batch 4, sequences of 256 tokens (conversations);
- dpo:    3 steps, 2 pairs per step (one micro batch), prompt + response up to 256 tokens
          (`--dpo-pairs 8 --dpo-seq-length 512`: issue 14's memory goal); its logged losses are printed,
          so two code roots can be checked for identical losses;
- rl:     the RL actor (`train_gpt_reinforce_actor.py`) at train_steps.py's rl workload
          (`peer.workload.default_workload("rl")`: 8 prompts x 4 samples x 32 new tokens, micro batch 16,
          RLOO, KL 0, function reward), `--rl-steps` steps; its logged (step, loss, grad_norm) rows are printed.
Peak RSS is the largest resident set of the stage's process tree (`wait4`'s ru_maxrss, in MB);
the machine's load average (`/proc/loadavg`, 1 minute) is printed beside each number, because
wall times on a shared machine move with it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the model reads a long question about rivers mountains prime numbers and small towns then writes "
         "a careful answer with three short steps each step names one fact and checks it against the last "
         "one before the final line says what was found and why it matters to the person who asked").split()


def sentence(index: int, words: int) -> str:
    """Deterministic filler text: `words` words picked by a multiplicative hash of (index, position)."""
    return " ".join(WORDS[(index * 7919 + position * 104729) % len(WORDS)] for position in range(words)).capitalize()


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def write_data(work: Path, dpo_seq_length: int = 256) -> dict[str, Path]:
    """Chat prompts, SFT conversations (> 256 tokens: truncated to exactly 256) and DPO pairs whose
    longer side (prompt + chosen, ~1 token per word) fills most of `dpo_seq_length`."""
    paths = {name: work / f"{name}.jsonl" for name in ("chat", "sft", "dpo")}
    write_jsonl(paths["chat"], [{"messages": [{"role": "user", "content": sentence(i, 12 + i) + "?"}]}
                                for i in range(16)])
    write_jsonl(paths["sft"], [{"conversations": [{"from": "User", "value": sentence(i, 60)},
                                                  {"from": "Assistant", "value": sentence(i + 100, 200)}]}
                               for i in range(64)])
    scale = dpo_seq_length / 256
    write_jsonl(paths["dpo"], [{"prompt": sentence(i, int(40 * scale)), "chosen": sentence(i + 200, int(120 * scale)),
                                "rejected": sentence(i + 300, int(100 * scale))} for i in range(16)])
    return paths


def rl_command(python: str, gpt: Path, checkpoint: Path, work: Path, steps: int, overrides: list[str]) -> list[str]:
    """The RL actor's entry point at train_steps.py's rl workload (its settings, data and overrides)."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from peer.workload import aligner_overrides, default_workload, write_data

    workload = default_workload("rl", steps, warmup_steps=0)
    data = write_data(workload, work)
    _, settings = aligner_overrides(workload, checkpoint, data, work / "rl")
    return [python, str(gpt / "train_gpt_reinforce_actor.py"), *settings, *overrides]


def run_stage(name: str, command: list[str], code_root: Path, threads: int, log: Path) -> dict:
    """Run one stage to completion; its wall time, peak RSS and the load average around it."""
    # benchmarks/ too: the rl stage's reward function is peer.workload's
    env = {**os.environ, "PYTHONPATH": f"{code_root}{os.pathsep}{REPO_ROOT / 'benchmarks'}",
           "OMP_NUM_THREADS": str(threads)}
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=code_root, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"stage {name} failed (exit {code}); see {log}:\n" + log.read_text()[-3000:])
    return {"stage": name, "peak_rss_mb": usage.ru_maxrss / 1024, "wall_s": wall,
            "load": f"{load_before:.2f}->{os.getloadavg()[0]:.2f}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", required=True, help="HF directory of SmolLM2-135M-Instruct (fp32)")
    parser.add_argument("--code-root", default=str(REPO_ROOT), help="checkout whose aligner, conf and examples run")
    parser.add_argument("--stages", default="import,chat,sft,dpo")
    parser.add_argument("--work", default=None, help="scratch directory (default: a new one under /tmp)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dpo-pairs", type=int, default=2, help="pairs per DPO step (= micro batch)")
    parser.add_argument("--dpo-seq-length", type=int, default=256, help="data.max_seq_length of the DPO stage")
    parser.add_argument("--dpo-steps", type=int, default=3)
    parser.add_argument("--rl-steps", type=int, default=2)
    parser.add_argument("--override", action="append", default=[],
                        help="config override of the sft, dpo and rl stages, e.g. model.activation_recompute=full")
    args = parser.parse_args()

    code_root = Path(args.code_root).resolve()
    work = Path(args.work) if args.work else Path(f"/tmp/real_model_memory_{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    data = write_data(work, args.dpo_seq_length)
    checkpoint = work / "checkpoint"
    python, gpt = sys.executable, code_root / "examples" / "nlp" / "gpt"
    quiet = ["logging.tensorboard=false", "logging.progress_bar=false", "checkpoint.save_at_end=false",
             "trainer.val_check_interval=0", "trainer.max_steps=3", "optim.warmup_steps=0"]
    commands = {
        "import": [python, "-m", "aligner.hf", "import", "--hf-dir", args.hf_dir, "--output", str(checkpoint)],
        "chat": [python, str(gpt / "chat.py"), f"init_from={checkpoint}", f"prompts_file={data['chat']}",
                 f"output_file={work / 'chat_out.jsonl'}", "batch_size=16", "sampling.max_new_tokens=64"],
        "sft": [python, str(gpt / "train_gpt_sft.py"), f"model.init_from={checkpoint}",
                f"data.train=[{{path: {data['sft']}, weight: 1.0}}]", "data.max_seq_length=256",
                "trainer.micro_batch_size=4", "trainer.global_batch_size=4", f"checkpoint.save_dir={work / 'sft'}",
                f"logging.log_dir={work / 'sft'}", *quiet, *args.override],
        "dpo": [python, str(gpt / "train_gpt_dpo.py"), f"model.init_from={checkpoint}",
                f"data.train=[{{path: {data['dpo']}, weight: 1.0}}]", f"data.max_seq_length={args.dpo_seq_length}",
                f"trainer.micro_batch_size={args.dpo_pairs}", f"trainer.global_batch_size={args.dpo_pairs}",
                f"checkpoint.save_dir={work / 'dpo'}", f"logging.log_dir={work / 'dpo'}", *quiet,
                f"trainer.max_steps={args.dpo_steps}", *args.override],
        "rl": rl_command(python, gpt, checkpoint, work, args.rl_steps, args.override),
    }
    stages = args.stages.split(",")
    unknown = sorted(set(stages) - set(commands))
    if unknown:
        raise SystemExit(f"unknown stages {unknown}; choose from {sorted(commands)}")
    if "import" not in stages and not checkpoint.is_dir():
        raise SystemExit(f"{checkpoint} does not exist: run the import stage first (same --work)")
    print(f"code {code_root}, work {work}, {args.threads} threads")
    print(f"{'stage':<8} {'peak RSS MB':>12} {'wall s':>8}  load (1 min, before->after)")
    for stage in stages:
        shutil.rmtree(work / stage, ignore_errors=True)  # a fresh metrics.jsonl (it is appended to)
        row = run_stage(stage, commands[stage], code_root, args.threads, work / f"{stage}.log")
        print(f"{row['stage']:<8} {row['peak_rss_mb']:>12.0f} {row['wall_s']:>8.1f}  {row['load']}", flush=True)
        if stage in ("sft", "dpo", "rl"):
            log_dir = work / "rl" / "logs" if stage == "rl" else work / stage  # rl: the workload's log_dir
            rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
            train = [row for row in rows if row.get("split") == "train" and "loss" in row]
            if stage == "rl":  # its loss is ~0 at ratio 1 (one minibatch): the gradient norm says more
                print("         rl (step, loss, grad_norm, step_time s): " + ", ".join(
                    f"({row['step']}, {row['loss']!r}, {row['grad_norm']!r}, {row['step_time']:.1f})" for row in train))
                continue
            print(f"         {stage} (step, loss, step_time s): "
                  + ", ".join(f"({row['step']}, {row['loss']!r}, {row['step_time']:.1f})" for row in train))


if __name__ == "__main__":
    main()
