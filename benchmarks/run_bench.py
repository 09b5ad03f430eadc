"""Run a set of benchmarks, one process each, and summarise their `ratio NAME VALUE` lines.

Each benchmark prints its own absolute numbers and one `ratio NAME VALUE` line per comparison
(peer time / ours, or floor / ours: above 1 means we are faster than the peer, or slower than the
floor allows); this script streams their output, collects those lines, and ends with a summary:
the machine's matmul and read rates (measured here before and after), each benchmark's wall time,
peak RSS, load and CPU pressure (the share of its wall time a task waited for a CPU: `aligner.runtime.
cpu_pressure`; over half of it is flagged, since then its timings measure the contention), and every ratio.

    python benchmarks/run_bench.py [--set real|toy|gpu] [--only NAME,...] [--threads 2]

`make bench` runs the real-model set, `make bench-toy` the toy set, `make test-gpu` the GPU set (after the
tests marked gpu).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

if not __package__:  # run as a file: make the `aligner` and `benchmarks` packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aligner.runtime import cpu_pressure  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
RATIO_PATTERN = re.compile(r"^ratio (\S+) ([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)$")


def ratio_line(name: str, value: float) -> str:
    """The line a benchmark prints per comparison (RATIO_PATTERN reads it back)."""
    if not re.fullmatch(r"\S+", name):
        raise ValueError(f"a ratio name has no spaces: {name!r}")
    return f"ratio {name} {value:.3f}"


def parse_ratios(output: str) -> list[tuple[str, float]]:
    """Every `ratio NAME VALUE` line of a benchmark's output, in order."""
    return [(match.group(1), float(match.group(2)))
            for match in map(RATIO_PATTERN.match, output.splitlines()) if match]


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str  # path from the repository root; an absent script is skipped (another branch may add it)
    args: tuple[str, ...] = ()


# The real-model set (`make bench`). One line per benchmark; `{threads}` is --threads.
REAL_MODEL_SET = (
    Benchmark("generation", "benchmarks/generation.py",
              ("--model", "smollm2", "--batches", "1,8,32,64", "--greedy", "--threads", "{threads}")),
    Benchmark("generation_anchors", "benchmarks/generation_anchors.py",
              ("--model", "smollm2", "--batches", "1,8,32", "--threads", "{threads}")),
    Benchmark("sft_step", "benchmarks/train_steps.py", ("--model", "smollm2", "--task", "sft", "--waterfall")),
    Benchmark("dpo_step", "benchmarks/train_steps.py", ("--model", "smollm2", "--task", "dpo", "--waterfall")),
    Benchmark("rl_step", "benchmarks/train_steps.py", ("--model", "smollm2", "--task", "rl")),
    Benchmark("grpo_step", "benchmarks/train_steps.py", ("--model", "smollm2", "--task", "grpo", "--waterfall")),
    Benchmark("bf16_vs_fp32", "benchmarks/precision.py", ("--model", "smollm2", "--threads", "{threads}")),
    Benchmark("continuous_batching", "benchmarks/continuous_batching.py",
              ("--model", "smollm2", "--threads", "{threads}")),
    Benchmark("shared_prefill", "benchmarks/shared_prefill.py", ("--model", "smollm2", "--threads", "{threads}")),
    Benchmark("async_rl", "benchmarks/async_rl.py", ("--task", "smollm2", "--repeats", "1", "--threads", "{threads}")),
)

# The toy-sized benchmarks (`make bench-toy`): per-call overheads on the 4-layer, 128-wide model.
TOY_SET = (
    Benchmark("bridge_overhead", "benchmarks/bridge_overhead.py", ("--threads", "1")),
    Benchmark("generation_toy", "benchmarks/generation.py", ("--threads", "1")),
    Benchmark("ppo_step_toy", "benchmarks/ppo_step.py", ("--threads", "1")),
    Benchmark("multi_turn_toy", "benchmarks/multi_turn.py", ("--threads", "1")),
    Benchmark("async_rl_toy", "benchmarks/async_rl.py", ("--threads", "{threads}")),
)

# The GPU set (`make test-gpu`, after the tests marked gpu): a ~1B Llama-style random model's decode with and
# without CUDA graphs against transformers, its SFT MFU, and a GRPO step on SmolLM2-135M.
GPU_1B = ("--layers", "16", "--hidden", "2048", "--heads", "32", "--query-groups", "8", "--ffn", "8192",
          "--vocab", "32000")
GPU_SET = (
    Benchmark("gpu_decode_1b", "benchmarks/generation.py",
              (*GPU_1B, "--precision", "bf16", "--compare-graphs", "--batches", "1,8,64", "--greedy",
               "--new-tokens", "128", "--repeats", "3")),
    Benchmark("gpu_sft_mfu_1b", "benchmarks/gpu_sft_mfu.py"),
    Benchmark("gpu_grpo_step", "benchmarks/gpu_grpo_step.py", ("--model", "smollm2")),
)

SETS = {"real": REAL_MODEL_SET, "toy": TOY_SET, "gpu": GPU_SET}


@dataclass
class Outcome:
    benchmark: Benchmark
    exit_code: int
    wall_s: float
    peak_rss_mb: float
    load: str
    ratios: list[tuple[str, float]]
    contended: Optional[float] = None  # the share of wall_s a task waited for a CPU; None: not measured (no PSI)

    def describe(self) -> str:
        state = "ok" if self.exit_code == 0 else f"FAILED (exit {self.exit_code})"
        line = (f"{self.benchmark.name}: {state}, {self.wall_s:.0f} s, peak RSS {self.peak_rss_mb:.0f} MB, "
                f"load {self.load}, ")
        if self.contended is None:
            return line + "CPU pressure not measured (no PSI)"
        line += f"a task waited for a CPU {self.contended:.0%} of the time"
        if self.contended > cpu_pressure.CONTENDED_SHARE:
            line += " (flag: other work contended for the CPUs; these timings are not of record)"
        return line


def run(benchmark: Benchmark, threads: int) -> Outcome:
    """Run one benchmark to completion, echoing its output; its wall time, peak RSS (wait4) and ratios."""
    from benchmarks.machine import load_average

    pressure = cpu_pressure.CpuPressure(cpu_pressure.pressure_file(), threads)
    command = [sys.executable, benchmark.script, *(arg.format(threads=threads) for arg in benchmark.args)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    print(f"\n=== {benchmark.name}: {' '.join(command[1:])}", flush=True)
    load_before = load_average()
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1)
    lines = []
    for line in process.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    measured = pressure.share(min_window_s=0.0)
    return Outcome(benchmark, process.returncode, time.perf_counter() - start, usage.ru_maxrss / 1024,
                   f"{load_before:.2f}->{load_average():.2f}", parse_ratios("".join(lines)),
                   None if measured is None else measured[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--set", choices=sorted(SETS), default="real")
    parser.add_argument("--only", default=None, help="comma-separated benchmark names of the set")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of every benchmark")
    args = parser.parse_args()
    from benchmarks.machine import MachineRates, cpu_header

    benchmarks = SETS[args.set]
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {b.name for b in benchmarks})
        if unknown:
            raise SystemExit(f"--only: no benchmark {unknown} in the {args.set} set "
                             f"({', '.join(b.name for b in benchmarks)})")
        benchmarks = tuple(b for b in benchmarks if b.name in wanted)

    import torch

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.set == "gpu" else "cpu")
    header = cpu_header()
    print(header, flush=True)
    rates_before = MachineRates.measure(device)
    outcomes, skipped = [], []
    for benchmark in benchmarks:
        if not (REPO_ROOT / benchmark.script).is_file():
            skipped.append(benchmark)
            continue
        outcomes.append(run(benchmark, args.threads))
    rates_after = MachineRates.measure(device)

    print(f"\n=== summary ({args.set} set, {args.threads} threads)")
    print(header)
    print(f"before: {rates_before.describe()}")
    print(f"after:  {rates_after.describe()}")
    for outcome in outcomes:
        print(outcome.describe())
    for benchmark in skipped:
        print(f"{benchmark.name}: skipped ({benchmark.script} is not in this checkout)")
    for outcome in outcomes:
        for name, value in outcome.ratios:
            print(ratio_line(name, value))
    if any(outcome.exit_code for outcome in outcomes):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
