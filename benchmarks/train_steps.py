"""Training steps against TRL's trainers on the same task and update: SFT, DPO and full RL steps, interleaved.

    .venv/bin/python benchmarks/train_steps.py [--model smollm2|toy|HF_DIR|GGUF|CHECKPOINT] \
        [--task sft|dpo|rl|grpo|all] [--steps 10] [--warmup 3] [--work DIR] [--waterfall]

Both sides train the same weights (`benchmarks/models.py`: our aligner checkpoint, TRL the HF export of it) on the
same records with the settings of one `peer.workload.Workload` (what is matched and what is not is listed there;
the update is the same, the arithmetic is not: ours skips some of TRL's). Each side is a worker process (ours: the
project's venv; TRL: its own venv, installed by benchmarks/peer/setup.sh on first use) and the two take turns step
by step (peer/protocol.py), so only one computes at a time. Prints, per task, each side's median step time, tokens
per step, peak RSS, minor page faults and CPU seconds per step (flags: a side still trending, a load above the
threads), what each side's model computed per step (token slots, output-layer positions, micro steps, a FLOP
estimate; flags where the micro steps or SFT's loss positions differ), then `ratio NAME VALUE` = median over
timed steps of (TRL step time / our step time): > 1 means ours is faster. `--waterfall` also times our trainer
with its shortcuts (`peer.workload.SHORTCUTS`) switched on one by one, in the same rounds as the two sides, and
prints the factor each adds, from TRL to our trainer as it runs. The 1-minute load average is printed before
and after, since the machine may be shared.
`--model toy` is the demo's task: a random-init model of the demo's size (4 layers, 128 wide) with its
character tokenizer, the arithmetic records and reward, and the demo's batch sizes; its ratios are named
`toy_...`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from peer.protocol import Worker, run_interleaved, step_ratio  # noqa: E402
from peer.workload import (  # noqa: E402
    NO_SHORTCUTS,
    RL_TASKS,
    SHORTCUTS,
    TASKS,
    default_workload,
    flop_estimate,
    waterfall,
    write_data,
)

TOY_DIR = REPO_ROOT / ".cache" / "bench" / "toy-demo"
PEER_SETUP = REPO_ROOT / "benchmarks" / "peer" / "setup.sh"
RATIO_NAMES = {"sft": "sft_step_vs_trl", "dpo": "dpo_step_vs_trl", "rl": "rloo_step_vs_trl",
               "grpo": "grpo_step_vs_trl"}


def peer_python() -> Path:
    """The TRL venv's python (installed on first use; one line and exit 2 if that fails)."""
    done = subprocess.run(["bash", str(PEER_SETUP)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "peer setup failed")
    return Path(done.stdout.strip().splitlines()[-1]) / "bin" / "python"


def toy_checkpoint() -> Path:
    """A random-init checkpoint of the demo's model size with the demo's character tokenizer (built once)."""
    from aligner import checkpointing

    checkpoint = TOY_DIR / "checkpoint"
    if (checkpoint / checkpointing.META_FILE).is_file():
        return checkpoint
    from aligner.demo import arithmetic
    from aligner.demo.tokenizer import train_char_tokenizer
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
    from aligner.runtime import distributed, seeds

    records = arithmetic.sft_records(512, seed=0)
    train_char_tokenizer([r["input"] + r["output"] for r in records], TOY_DIR / "tokenizer")
    distributed.initialize(distributed.ParallelConfig())
    seeds.set_seed(0)
    cfg = GPTConfig(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512,
                    vocab_size=256, max_position_embeddings=64)
    model = build_gpt_model(cfg, transformer_config(cfg))
    checkpointing.save(TOY_DIR / "partial", [model], model_config=cfg.to_dict(), tokenizer_dir=TOY_DIR / "tokenizer")
    os.replace(TOY_DIR / "partial", checkpoint)
    return checkpoint


def worker_environment(threads: int) -> dict[str, str]:
    """What both sides' worker processes get, the same for each: their threads, the allocator settings our
    process makes for itself (`cpu_bridge.reuse_freed_memory`; the peer's glibc reads them from GLIBC_TUNABLES,
    so it neither mmaps nor trims its large temporaries either), no tokenizer threads, and the repository on the
    path (the toy's reward: aligner.demo)."""
    from aligner.runtime import cpu_bridge

    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
            "GLIBC_TUNABLES": cpu_bridge.glibc_tunables(), "PYTHONPATH": str(REPO_ROOT)}


def make_workers(work, work_json: Path, resolved, peer: Path, data: Path, scratch: Path,
                 with_waterfall: bool) -> tuple[Worker, Worker]:
    """Our worker (with the waterfall's variants, if asked) and TRL's, on one workload file, one data file and one
    environment (`worker_environment`)."""
    env = worker_environment(work.threads)
    ours = Worker("ours", [sys.executable, str(REPO_ROOT / "benchmarks/peer/aligner_worker.py"), str(work_json),
                           str(resolved.checkpoint_dir), str(data), str(scratch / "ours")], scratch / "ours.log", env,
                  waterfall(work.task) if with_waterfall else ())
    trl = Worker("trl", [str(peer), str(REPO_ROOT / "benchmarks/peer/trl_worker.py"), str(work_json),
                         str(resolved.hf_dir), str(data), str(scratch / "trl")], scratch / "trl.log", dict(env))
    return ours, trl


def compare(task: str, steps: int, warmup: int, resolved, peer: Path, work_dir: Path, toy: bool,
            with_waterfall: bool = False) -> None:
    work = default_workload(task, steps, warmup, toy=toy)
    scratch = work_dir / task
    data = write_data(work, scratch)
    work_json = scratch / "workload.json"
    work_json.write_text(work.to_json())
    ours, trl = make_workers(work, work_json, resolved, peer, data, scratch, with_waterfall)
    load_before = os.getloadavg()[0]
    *our_results, peer_result = run_interleaved([ours, trl], work.total_steps,
                                                progress=lambda line: print(f"  {task} {line}", file=sys.stderr,
                                                                            flush=True))
    load_after = os.getloadavg()[0]
    our_result = our_results[-1]  # with the waterfall: every shortcut on, as the trainer runs

    print(f"{task}: {resolved.spec}, global batch {work.global_batch_size}, micro batch {work.micro_batch_size}, "
          + (f"{work.prompts_per_step} prompts x {work.samples_per_prompt} samples x {work.max_new_tokens} new "
             "tokens, " if task in RL_TASKS else f"up to {work.max_seq_length} tokens, ")
          + f"fp32, {work.threads} threads, {work.steps} timed steps after {work.warmup_steps} warm-up; "
          f"load {load_before:.2f}->{load_after:.2f}")
    for name, result in (("ours", our_result), ("trl", peer_result)):
        timed = result.seconds[work.warmup_steps:]
        figures = result.figures[work.warmup_steps:]
        print(f"  {name:<5} step {statistics.median(timed):8.3f} s (min {min(timed):.3f}, max {max(timed):.3f})  "
              f"{'generated' if task in RL_TASKS else 'trained'} tokens/step {statistics.median(result.tokens):7.0f}  "
              f"peak RSS {result.peak_rss_mb:6.0f} MB  per step: "
              f"{statistics.median(step['minor_faults'] for step in figures):,.0f} minor page faults, "
              f"{statistics.median(step['cpu_seconds'] for step in figures):.2f} CPU s")
        print(f"  {name:<5} computed per step: {describe_computed(figures[-1])}")
        drift = trend(timed)
        if drift is not None:
            print(f"  {name:<5} flag: still trending: the last half of the timed steps took {drift:+.1%} against "
                  "the first half; more warm-up steps (--warmup) would measure it settled")
    for flag in unequal_work(our_result.figures[-1], peer_result.figures[-1]):
        print(f"  flag: {flag}")
    shares = [{key: value for key, value in step.items() if key.startswith("share_")}
              for step in our_result.figures[work.warmup_steps:]]
    if shares and shares[0]:  # the RL actor's phases, as shares of its step (median over the timed steps)
        print("  ours  where the step's time goes: " + ", ".join(
            f"{name.removeprefix('share_')} {statistics.median(step.get(name, 0.0) for step in shares):.1%}"
            for name in shares[0]))
    if with_waterfall:
        print_waterfall(task, peer_result, our_results, work.warmup_steps)
    if max(load_before, load_after) > work.threads + 1.0:  # (the 1-minute average lags: a run just ended adds ~1)
        print(f"  flag: the load ({load_before:.2f}->{load_after:.2f}) exceeds the {work.threads} threads: other work "
              "shared the cores; rerun on a quiet machine before quoting these figures")
    ratio = step_ratio(peer_result.seconds, our_result.seconds, work.warmup_steps)
    prefix = "toy_" if toy else "" if resolved.spec == "smollm2" else "custom_"
    print(f"ratio {prefix}{RATIO_NAMES[task]} {ratio:.3f}", flush=True)


def describe_computed(figures: dict[str, float]) -> str:
    """One step's counted work (`peer.workload.STEP_COUNTS`) in words, with its FLOP estimate."""
    text = (f"training {figures['train_micro_steps']:.0f} micro steps over {figures['train_slots']:,.0f} token slots, "
            f"output layer at {figures['train_lm_positions']:,.0f}; other passes {figures['nograd_slots']:,.0f} slots, "
            f"output layer at {figures['nograd_lm_positions']:,.0f}; ~{flop_estimate(figures) / 1e9:,.1f} GFLOP")
    if "loss_positions" in figures:
        text += f"; the loss at {figures['loss_positions']:,.0f} positions"
    return text


LOSS_POSITIONS_TOLERANCE = 0.01  # TRL tokenizes prompt + completion at once: a token may merge across the seam


def unequal_work(ours: dict[str, float], peer: dict[str, float]) -> list[str]:
    """What the two sides' counts say is not the same task and update: a different number of micro steps
    (training forwards per optimizer step), or positions an SFT loss reads that differ by more than
    LOSS_POSITIONS_TOLERANCE (ours tokenizes the prompt and the completion apart, TRL the two together and
    cuts at the prompt's length, so the seam can differ by a token per row)."""
    flags = []
    if ours["train_micro_steps"] != peer["train_micro_steps"]:
        flags.append(f"unequal micro steps: ours {ours['train_micro_steps']:.0f}, "
                     f"TRL {peer['train_micro_steps']:.0f} training forwards per step")
    if "loss_positions" in ours:
        theirs = peer.get("loss_positions", 0.0)
        if abs(ours["loss_positions"] - theirs) > LOSS_POSITIONS_TOLERANCE * max(ours["loss_positions"], theirs):
            flags.append(f"unequal loss positions: ours {ours['loss_positions']:.0f}, TRL {theirs:.0f} per step")
    return flags


def print_waterfall(task: str, peer_result, our_results, warmup_steps: int) -> None:
    """TRL, then our trainer with its shortcuts switched on one by one (all timed in the same rounds): each
    factor is the median over rounds of (the previous row's step / this row's), so the factors multiply to about
    the whole ratio (exactly for a single round). The first factor is TRL's extra work over our trainer without
    shortcuts (its framework, padding, generation code); the others, each shortcut's."""
    print(f"  waterfall ({task}; each factor: the row above's step time over this row's, median over the timed "
          "rounds):")
    rows = [("TRL", peer_result)] + [(result.name.split(":", 1)[1], result) for result in our_results]
    previous = None
    for label, result in rows:
        timed = result.seconds[warmup_steps:]
        figures = result.figures[-1]
        line = (f"    {label if previous is None else 'ours, ' + describe_variant(label):<58} "
                f"{statistics.median(timed):8.3f} s  ~{flop_estimate(figures) / 1e9:8,.1f} GFLOP")
        if previous is not None:
            line += f"  x{step_ratio(previous, result.seconds, warmup_steps):.2f}"
        print(line)
        previous = result.seconds


def describe_variant(variant: str) -> str:
    """A waterfall row's label: the shortcut its variant adds to the row above."""
    if variant == NO_SHORTCUTS:
        return "no shortcut"
    newest = variant.split("+")[-1]
    return f"+ {newest}" if "+" in variant else newest


TREND_LIMIT = 0.05  # the last half of the timed steps this much faster (or slower) than the first: not settled


def trend(seconds: list[float]) -> Optional[float]:
    """The change from the first half of the timed steps to the last (median against median), when it is beyond
    TREND_LIMIT; None when the steps have settled (or are too few to tell: under 4)."""
    if len(seconds) < 4:
        return None
    half = len(seconds) // 2
    first, last = statistics.median(seconds[:half]), statistics.median(seconds[-half:])
    change = last / first - 1.0
    return change if abs(change) > TREND_LIMIT else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="an HF dir, a .gguf file, an aligner checkpoint, smollm2, or toy")
    parser.add_argument("--task", default="all", choices=(*TASKS, "all"))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--work", default=None, help="scratch directory (default: a new temporary one)")
    parser.add_argument("--waterfall", action="store_true",
                        help="also time our trainer with its shortcuts switched on one by one (" +
                             ", ".join(SHORTCUTS) + "), in the same rounds")
    args = parser.parse_args()

    from aligner.config import run_main

    def run() -> None:
        from machine import cpu_header
        from models import resolve_model

        print(cpu_header(), flush=True)
        toy = args.model == "toy"
        resolved = resolve_model(str(toy_checkpoint()) if toy else args.model)
        peer = peer_python()
        with tempfile.TemporaryDirectory() as tmp:
            work_dir = Path(args.work) if args.work else Path(tmp)
            for task in TASKS if args.task == "all" else (args.task,):
                compare(task, args.steps, args.warmup, resolved, peer, work_dir, toy, args.waterfall)

    run_main(run)


if __name__ == "__main__":
    main()
