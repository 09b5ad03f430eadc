"""Asynchronous RL against the synchronous run, per step and (on the toy task) to the same held-out accuracy.

Each run is one of three modes, alternated (ABC CBA ...: a drift of the machine's pace hits every mode alike)
--repeats times:

  sync-2t    the synchronous run as the demo runs it, one process on --threads threads (every phase on all cores)
  async-1+1  rollout.asynchronous with max_staleness 1 (and the correction it needs, loss.importance_sampling=
             token): the trainer on --threads - 1 threads, the generation worker on 1, each on cores of its own
  sync-1t    the synchronous run on --threads - 1 threads: what the trainer alone gets in async-1+1 (how much
             of the gain is the overlap rather than threads used better)

--task toy (`make bench-toy`): the GRPO stage of `make demo` (examples/demo/run_demo.py: GROUP_RL_OVERRIDES,
algorithm=grpo, 20 steps of 64 prompts x 8 samples on the toy arithmetic model) from the demo's SFT checkpoint,
at --lr (5e-5, half the demo's: at the demo's 1e-4 one update moves this policy 0.04-0.4 nats per token, and
one-step-old rollouts then lose 4-13 points of held-out accuracy; at 5e-5 neither run loses accuracy against the
demo's); each run is then evaluated greedily on the demo's 500 held-out problems. Without --sft the SFT
checkpoint of an earlier run in --workdir is used, or trained there first (run_demo.py --stages sft: about 6
minutes on 2 cores).

--task smollm2 (`make bench`): the RLOO stage of `make demo-real` (examples/demo/run_demo_real.py: the GRPO LoRA
recipe on SmolLM2-135M-Instruct, 8 prompts x 4 samples of up to 48 tokens per step, one update) for --steps
steps from the pinned model, step times only (its held-out evaluation is the demo's). The asynchronous run
recomputes the old logprobs (the correction needs the proximal policy); the demo's synchronous run takes them
from the engine, so the asynchronous step carries one forward pass more, and sync-2t prints its generation share.

Printed per mode: the median step time over steps 2.. (the first holds the worker's start), the whole run's wall
time (process start to exit), the held-out accuracy (toy); and `ratio async_rl_step_vs_sync` (sync-2t /
async-1+1 step time, median over repeats; `async_rl_smollm2_step_vs_sync` on SmolLM2), `ratio
async_rl_run_vs_sync` (whole runs, toy), and whether the accuracies are within 2 points (toy).

    python benchmarks/async_rl.py [--task toy|smollm2] [--workdir results/async_rl] [--sft CHECKPOINT]
        [--repeats 2] [--threads 2] [--lr 5e-5] [--steps 5]
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
from benchmarks.peer.protocol import in_turn  # noqa: E402
from benchmarks.run_bench import ratio_line  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "examples" / "demo"))
from run_demo import ASYNC_RL_SETTINGS, GPT_EXAMPLES, GROUP_RL_OVERRIDES, evaluate  # noqa: E402
from run_demo_real import RL_OVERRIDES as REAL_RL_OVERRIDES  # noqa: E402
from run_demo_real import RL_RECIPE as REAL_RL_RECIPE  # noqa: E402

from aligner.checkpointing import latest_checkpoint  # noqa: E402
from aligner.training.metrics import read_metrics  # noqa: E402

ASYNC_SETTINGS = (*ASYNC_RL_SETTINGS, "rollout.asynchronous.worker_threads=1")  # the demo's async row's


def modes(threads: int) -> dict[str, tuple[int, tuple[str, ...]]]:
    """name -> (the trainer's OMP threads, extra settings)."""
    return {f"sync-{threads}t": (threads, ()),
            f"async-{threads - 1}+1": (threads - 1, ASYNC_SETTINGS),
            f"sync-{threads - 1}t": (threads - 1, ())}


class ToyTask:
    """The demo's GRPO stage from its SFT checkpoint, then the greedy held-out evaluation."""
    ratio_prefix = "async_rl"

    def __init__(self, work: Path, sft: Path | None, threads: int, lr: float):
        self.data = work / "data"
        if sft is None:
            sft = latest_checkpoint(work / "sft" / "checkpoints") if (work / "sft" / "checkpoints").is_dir() else None
            if sft is None:
                subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "demo" / "run_demo.py"), "--workdir",
                                str(work), "--stages", "sft"], cwd=REPO_ROOT, check=True,
                               env={**os.environ, "OMP_NUM_THREADS": str(threads)})
                sft = latest_checkpoint(work / "sft" / "checkpoints")
        elif not (self.data / "rl_prompts.jsonl").exists():
            self.data = sft.resolve().parents[2] / "data"  # a demo workdir's checkpoint: its data beside it
        self.sft, self.lr = sft, lr
        self.describe = f"the demo's GRPO stage from SFT checkpoint {sft}; lr {lr:g}"

    def command(self, out: Path) -> list[str]:
        return [str(GPT_EXAMPLES / "train_gpt_reinforce_actor.py"), f"model.init_from={self.sft}",
                f"data.prompts={self.data / 'rl_prompts.jsonl'}", "reward.source=function",
                "reward.function=aligner.demo.arithmetic:score_response", *GROUP_RL_OVERRIDES, "algorithm=grpo",
                f"optim.lr={self.lr}"]

    def asynchronous(self) -> tuple[str, ...]:
        return ASYNC_SETTINGS

    def accuracy(self, out: Path) -> float:
        return evaluate(f"evaluate {out.name}", latest_checkpoint(out / "checkpoints"),
                        self.data / "heldout_prompts.jsonl", out / "eval.json")["all"]


class SmolLM2Task:
    """The real demo's RLOO stage on the pinned SmolLM2-135M-Instruct, --steps steps, step times only."""
    ratio_prefix = "async_rl_smollm2"

    def __init__(self, work: Path, steps: int):
        from aligner.demo.instructions import prompt_records
        from benchmarks.models import resolve_model

        self.model = resolve_model("smollm2").checkpoint_dir
        self.prompts = work / "data" / "train.jsonl"
        self.prompts.parent.mkdir(parents=True, exist_ok=True)
        self.prompts.write_text("".join(json.dumps(row) + "\n" for row in prompt_records("train", 1024, seed=0)))
        self.steps = steps
        self.describe = f"the real demo's RLOO stage on SmolLM2-135M-Instruct, {steps} steps"

    def command(self, out: Path) -> list[str]:
        return [str(GPT_EXAMPLES / "train_gpt_reinforce_actor.py"), "--config", str(REAL_RL_RECIPE),
                f"model.init_from={self.model}", f"data.prompts={self.prompts}", *REAL_RL_OVERRIDES,
                f"trainer.max_steps={self.steps}", "checkpoint.save_at_end=false"]

    def asynchronous(self) -> tuple[str, ...]:
        return (*ASYNC_SETTINGS, "loss.recompute_old_logprobs=true")  # the demo takes them from the engine

    def accuracy(self, out: Path) -> None:
        return None


def run_mode(task, out: Path, threads: int, extra: tuple) -> dict:
    """One run of `task`; its wall time, median step time (steps 2..), generation share and held-out accuracy."""
    command = [sys.executable, *task.command(out), *extra, "logging.progress_bar=false", "logging.tensorboard=false",
               "checkpoint.resume=false", f"checkpoint.save_dir={out / 'checkpoints'}", f"logging.log_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        print(result.stdout[-3000:])
        raise SystemExit(f"async_rl: the run in {out} failed with exit code {result.returncode}")
    rows = read_metrics(out, "train", newest_attempt=True)[1:]
    return {"wall": wall, "step": statistics.median(row["step_time"] for row in rows),
            "generation_share": statistics.median(row["time_generation"] / row["step_time"] for row in rows),
            "accuracy": task.accuracy(out), "staleness": max(row.get("async/staleness_max", 0.0) for row in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=("toy", "smollm2"), default="toy")
    parser.add_argument("--workdir", type=Path, default=None, help="default: results/async_rl[_smollm2]")
    parser.add_argument("--sft", type=Path, help="toy: the demo's SFT checkpoint (default: trained in --workdir)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="cores the runs may use (async: threads - 1 + 1)")
    parser.add_argument("--lr", type=float, default=5e-5, help="toy: every run's optim.lr (the demo's: 1e-4)")
    parser.add_argument("--steps", type=int, default=5, help="smollm2: steps per run (at least 3)")
    args = parser.parse_args()
    if args.threads < 2:
        raise SystemExit("async_rl: --threads must be at least 2 (the trainer and the worker each need one)")
    if args.steps < 3:
        raise SystemExit("async_rl: --steps must be at least 3 (the step times are steps 2..)")
    toy = args.task == "toy"
    work = (args.workdir or REPO_ROOT / "results" / ("async_rl" if toy else "async_rl_smollm2")).resolve()
    task = ToyTask(work, args.sft, args.threads, args.lr) if toy else SmolLM2Task(work, args.steps)
    print(f"CPU: {cpu_model()}; {os.cpu_count()} logical CPUs; load {load_average():.2f}; {task.describe}")
    plan = modes(args.threads)
    sync_name, async_name = f"sync-{args.threads}t", f"async-{args.threads - 1}+1"
    results: dict[str, list[dict]] = {name: [] for name in plan}
    for repeat in range(args.repeats):
        for name in in_turn(plan, repeat):
            threads, asynchronous = plan[name]
            result = run_mode(task, work / f"{name}_{repeat}", threads, task.asynchronous() if asynchronous else ())
            results[name].append(result)
            accuracy = "" if result["accuracy"] is None else f", held-out {100 * result['accuracy']:.1f} %"
            print(f"repeat {repeat + 1} {name:>10}: step {result['step']:.2f} s (median of steps 2..; generation "
                  f"{100 * result['generation_share']:.0f} % of it), run {result['wall']:.1f} s{accuracy}, "
                  f"staleness max {result['staleness']:.0f}; load {load_average():.2f}", flush=True)
    print(f"\n{'mode':>10} {'step s':>8} {'run s':>8} {'held-out %':>11}   (median over {args.repeats} repeats)")
    summary = {}
    for name, rows in results.items():
        summary[name] = {key: statistics.median(row[key] for row in rows) for key in ("step", "wall")}
        summary[name]["accuracy"] = None if not toy else statistics.median(row["accuracy"] for row in rows)
        accuracy = "-" if summary[name]["accuracy"] is None else f"{100 * summary[name]['accuracy']:.1f}"
        print(f"{name:>10} {summary[name]['step']:>8.2f} {summary[name]['wall']:>8.1f} {accuracy:>11}")
    sync, asynchronous = summary[sync_name], summary[async_name]
    if toy:
        gap = 100 * abs(asynchronous["accuracy"] - sync["accuracy"])
        print(f"held-out accuracy: async {100 * asynchronous['accuracy']:.1f} % vs sync "
              f"{100 * sync['accuracy']:.1f} % ({gap:.1f} points apart: {'within' if gap <= 2 else 'NOT within'} "
              f"2 points)")
    print(ratio_line(f"{task.ratio_prefix}_step_vs_sync", sync["step"] / asynchronous["step"]))
    if toy:
        print(ratio_line("async_rl_run_vs_sync", sync["wall"] / asynchronous["wall"]))
    (work / "summary.json").write_text(json.dumps({"cpu": cpu_model(), "task": args.task, "runs": results,
                                                   "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
