"""Asynchronous RL against the synchronous run: the demo's GRPO stage, per step and to the same held-out accuracy.

The GRPO stage of `make demo` (examples/demo/run_demo.py: GROUP_RL_OVERRIDES, algorithm=grpo, 20 steps of 64
prompts x 8 samples on the toy arithmetic model) from the demo's SFT checkpoint, at --lr (5e-5, half the demo's:
at the demo's 1e-4 one update moves this policy 0.04-0.4 nats per token, and one-step-old rollouts then lose
4-13 points of held-out accuracy; at 5e-5 neither run loses accuracy against the demo's), run three ways,
alternated (ABC CBA ...: a drift of the machine's pace hits every mode alike) --repeats times:

  sync-2t    the synchronous run as the demo runs it, one process on --threads threads (every phase on all cores)
  async-1+1  rollout.asynchronous with max_staleness 1 (and the correction it needs, loss.importance_sampling=
             token): the trainer on --threads - 1 threads, the generation worker on 1, each on cores of its own
  sync-1t    the synchronous run on --threads - 1 threads: what the trainer alone gets in async-1+1 (how much
             of the gain is the overlap rather than threads used better)

Each run is then evaluated greedily on the demo's 500 held-out problems. Printed per mode: the median step time
over steps 2.. (the first holds the worker's start), the whole run's wall time (process start to exit), the
held-out accuracy; and `ratio async_rl_step_vs_sync` (sync-2t / async-1+1 step time, median over repeats),
`ratio async_rl_run_vs_sync` (whole runs), and whether the accuracies are within 2 points.

    python benchmarks/async_rl.py [--workdir results/async_rl] [--sft CHECKPOINT] [--repeats 2] [--threads 2]
        [--lr 5e-5]

Without --sft the SFT checkpoint of an earlier run in --workdir is used, or trained there first
(run_demo.py --stages sft: about 6 minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import cpu_model, load_average  # noqa: E402
from benchmarks.run_bench import ratio_line  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "examples" / "demo"))
from run_demo import GPT_EXAMPLES, GROUP_RL_OVERRIDES, evaluate  # noqa: E402

from aligner.checkpointing import latest_checkpoint  # noqa: E402
from aligner.training.metrics import read_metrics  # noqa: E402

ASYNC_SETTINGS = ("rollout.asynchronous.enabled=true", "rollout.asynchronous.max_staleness=1",
                  "rollout.asynchronous.worker_threads=1", "loss.importance_sampling=token")


def modes(threads: int) -> dict[str, tuple[int, tuple[str, ...]]]:
    """name -> (the trainer's OMP threads, extra settings)."""
    return {f"sync-{threads}t": (threads, ()),
            f"async-{threads - 1}+1": (threads - 1, ASYNC_SETTINGS),
            f"sync-{threads - 1}t": (threads - 1, ())}


def run_grpo(sft: Path, data: Path, out: Path, threads: int, extra: tuple, lr: float) -> dict:
    """One GRPO stage; its wall time, median step time (steps 2..) and held-out accuracy."""
    command = [sys.executable, str(GPT_EXAMPLES / "train_gpt_reinforce_actor.py"), f"model.init_from={sft}",
               f"data.prompts={data / 'rl_prompts.jsonl'}", "reward.source=function",
               "reward.function=aligner.demo.arithmetic:score_response", *GROUP_RL_OVERRIDES, "algorithm=grpo",
               f"optim.lr={lr}", *extra, "logging.progress_bar=false", "logging.tensorboard=false",
               f"checkpoint.save_dir={out / 'checkpoints'}", f"logging.log_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        print(result.stdout[-3000:])
        raise SystemExit(f"async_rl: the run in {out} failed with exit code {result.returncode}")
    rows = read_metrics(out, "train", newest_attempt=True)
    steps = [row["step_time"] for row in rows[1:]]
    accuracy = evaluate(f"evaluate {out.name}", latest_checkpoint(out / "checkpoints"),
                        data / "heldout_prompts.jsonl", out / "eval.json")["all"]
    return {"wall": wall, "step": statistics.median(steps), "accuracy": accuracy,
            "staleness": max(row.get("async/staleness_max", 0.0) for row in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=REPO_ROOT / "results" / "async_rl")
    parser.add_argument("--sft", type=Path, help="the demo's SFT checkpoint (default: trained in --workdir)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="cores the runs may use (async: threads - 1 + 1)")
    parser.add_argument("--lr", type=float, default=5e-5, help="every run's optim.lr (the demo's: 1e-4)")
    args = parser.parse_args()
    if args.threads < 2:
        raise SystemExit("async_rl: --threads must be at least 2 (the trainer and the worker each need one)")
    work = args.workdir.resolve()
    data = work / "data"
    sft = args.sft
    if sft is None:
        sft = latest_checkpoint(work / "sft" / "checkpoints") if (work / "sft" / "checkpoints").is_dir() else None
        if sft is None:
            subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "demo" / "run_demo.py"), "--workdir",
                            str(work), "--stages", "sft"], cwd=REPO_ROOT, check=True,
                           env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            sft = latest_checkpoint(work / "sft" / "checkpoints")
    elif not (data / "rl_prompts.jsonl").exists():
        data = sft.resolve().parents[2] / "data"  # a demo workdir's checkpoint: its data beside it
    print(f"CPU: {cpu_model()}; {os.cpu_count()} logical CPUs; load {load_average():.2f}; SFT checkpoint {sft}; "
          f"lr {args.lr:g}")
    plan = modes(args.threads)
    results: dict[str, list[dict]] = {name: [] for name in plan}
    for repeat in range(args.repeats):
        order = list(plan) if repeat % 2 == 0 else list(reversed(plan))
        for name in order:
            threads, extra = plan[name]
            result = run_grpo(sft, data, work / f"{name}_{repeat}", threads, extra, args.lr)
            results[name].append(result)
            print(f"repeat {repeat + 1} {name:>10}: step {result['step']:.2f} s (median of steps 2..), run "
                  f"{result['wall']:.1f} s, held-out {100 * result['accuracy']:.1f} %, staleness max "
                  f"{result['staleness']:.0f}; load {load_average():.2f}", flush=True)
    print(f"\n{'mode':>10} {'step s':>8} {'run s':>8} {'held-out %':>11}   (median over {args.repeats} repeats)")
    summary = {}
    for name, rows in results.items():
        summary[name] = {key: statistics.median(row[key] for row in rows) for key in ("step", "wall", "accuracy")}
        print(f"{name:>10} {summary[name]['step']:>8.2f} {summary[name]['wall']:>8.1f} "
              f"{100 * summary[name]['accuracy']:>11.1f}")
    sync, asynchronous = summary[f"sync-{args.threads}t"], summary[f"async-{args.threads - 1}+1"]
    gap = 100 * abs(asynchronous["accuracy"] - sync["accuracy"])
    print(f"held-out accuracy: async {100 * asynchronous['accuracy']:.1f} % vs sync {100 * sync['accuracy']:.1f} % "
          f"({gap:.1f} points apart: {'within' if gap <= 2 else 'NOT within'} 2 points)")
    print(ratio_line("async_rl_step_vs_sync", sync["step"] / asynchronous["step"]))
    print(ratio_line("async_rl_run_vs_sync", sync["wall"] / asynchronous["wall"]))
    (work / "summary.json").write_text(json.dumps({"cpu": cpu_model(), "runs": results, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
