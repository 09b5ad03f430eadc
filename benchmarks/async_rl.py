"""Asynchronous RL against the synchronous run: the demo's GRPO stage, per step and to the same held-out accuracy.

The GRPO stage of `make demo` (examples/demo/run_demo.py: GROUP_RL_OVERRIDES, algorithm=grpo, 20 steps of 64
prompts x 8 samples on the toy arithmetic model) from the demo's SFT checkpoint, run three ways, alternated
(ABC CBA ...: a drift of the machine's pace hits every mode alike) --repeats times:

  sync-2t    the synchronous run as the demo runs it, one process on --threads threads (every phase on all cores)
  async-1+1  rollout.asynchronous with max_staleness 1 (and the correction it needs, loss.importance_sampling=
             token): the trainer on --threads - 1 threads, the generation worker on 1, each on cores of its own
  async-1+1-28  the same for --async-steps steps: one-step-old rollouts teach less per step, and this run is the
             one that should reach the synchronous run's accuracy
  sync-1t    the synchronous run on --threads - 1 threads: what the trainer alone gets in async-1+1 (how much
             of the gain is the overlap rather than threads used better)

Each run is then evaluated greedily on the demo's 500 held-out problems. Printed per mode: the median step time
over steps 2.. (the first holds the worker's start), the whole run's wall time (process start to exit), the
held-out accuracy; `ratio async_rl_step_vs_sync` (sync-2t / async-1+1 step time, median over repeats),
`ratio async_rl_run_vs_sync` (whole runs of the same steps), whether each asynchronous run's accuracy is within
2 points of the synchronous one, and `ratio async_rl_to_sync_accuracy_vs_sync` (the synchronous run's wall time
over the longer asynchronous run's, when that one got there).

    python benchmarks/async_rl.py [--workdir results/async_rl] [--sft CHECKPOINT] [--repeats 2] [--threads 2]
        [--async-steps 28]

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

GROUP_RL_STEPS = int(next(setting for setting in GROUP_RL_OVERRIDES
                          if setting.startswith("trainer.max_steps=")).split("=")[1])
ASYNC_SETTINGS = ("rollout.asynchronous.enabled=true", "rollout.asynchronous.max_staleness=1",
                  "rollout.asynchronous.worker_threads=1", "loss.importance_sampling=token")


def modes(threads: int, longer: int) -> dict[str, tuple[int, tuple[str, ...]]]:
    """name -> (the trainer's OMP threads, extra settings)."""
    return {f"sync-{threads}t": (threads, ()),
            f"async-{threads - 1}+1": (threads - 1, ASYNC_SETTINGS),
            f"async-{threads - 1}+1-{longer}": (threads - 1, (*ASYNC_SETTINGS, f"trainer.max_steps={longer}")),
            f"sync-{threads - 1}t": (threads - 1, ())}


def run_grpo(sft: Path, data: Path, out: Path, threads: int, extra: tuple) -> dict:
    """One GRPO stage; its wall time, median step time (steps 2..) and held-out accuracy."""
    command = [sys.executable, str(GPT_EXAMPLES / "train_gpt_reinforce_actor.py"), f"model.init_from={sft}",
               f"data.prompts={data / 'rl_prompts.jsonl'}", "reward.source=function",
               "reward.function=aligner.demo.arithmetic:score_response", *GROUP_RL_OVERRIDES, "algorithm=grpo",
               *extra, "logging.progress_bar=false", "logging.tensorboard=false",
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
    parser.add_argument("--async-steps", type=int, default=28,
                        help="steps of the longer asynchronous run (the one that should reach sync's accuracy)")
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
    print(f"CPU: {cpu_model()}; {os.cpu_count()} logical CPUs; load {load_average():.2f}; SFT checkpoint {sft}")
    plan = modes(args.threads, args.async_steps)
    results: dict[str, list[dict]] = {name: [] for name in plan}
    for repeat in range(args.repeats):
        order = list(plan) if repeat % 2 == 0 else list(reversed(plan))
        for name in order:
            threads, extra = plan[name]
            result = run_grpo(sft, data, work / f"{name}_{repeat}", threads, extra)
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
    longer = summary[f"async-{args.threads - 1}+1-{args.async_steps}"]
    for name, result in ((f"{GROUP_RL_STEPS} steps", asynchronous), (f"{args.async_steps} steps", longer)):
        gap = 100 * (result["accuracy"] - sync["accuracy"])
        verdict = "at least within 2 points" if gap >= -2 else "NOT within 2 points"
        print(f"held-out accuracy: async {name} {100 * result['accuracy']:.1f} % vs sync {GROUP_RL_STEPS} steps "
              f"{100 * sync['accuracy']:.1f} % ({gap:+.1f} points: {verdict})")
    print(ratio_line("async_rl_step_vs_sync", sync["step"] / asynchronous["step"]))
    print(ratio_line("async_rl_run_vs_sync", sync["wall"] / asynchronous["wall"]))
    # Time to the synchronous run's accuracy: its whole run against the longer asynchronous run's, if that got there.
    if 100 * (longer["accuracy"] - sync["accuracy"]) >= -2:
        print(ratio_line("async_rl_to_sync_accuracy_vs_sync", sync["wall"] / longer["wall"]))
    else:
        print(f"async_rl: {args.async_steps} asynchronous steps did not reach the synchronous accuracy within 2 "
              "points: no time-to-accuracy ratio")
    (work / "summary.json").write_text(json.dumps({"cpu": cpu_model(), "runs": results, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
