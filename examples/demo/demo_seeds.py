"""Both demos' RL stages from several seeds, with the margins each row must keep (exit status 1 if one fails).

    python examples/demo/demo_seeds.py toy --seeds 1,2,3     # make demo: SFT per seed, the GRPO family on each
    python examples/demo/demo_seeds.py real --seeds 1,2,3    # make demo-real: RLOO and iterative DPO per seed

toy: each seed trains its own SFT model (the seed sets the data order) and the group methods from it; every
group row must beat that seed's SFT by TOY_MARGIN points of held-out greedy accuracy. real: the base model is
imported and evaluated once; RLOO and iterative DPO run per seed (sampling, data order); each must beat the base
by REAL_MARGIN points of held-out prompts satisfied and keep the general answers: on none of the five general
prompts may the share of sampled answers with a fault (`instructions.general_answer_faults`: French words, the
question echoed, the France answer without Paris; 64 answers at T=0.7 per prompt and model) be significantly
higher than the base's (`intervals.rate_rose`), and the KL to the base on those prompts stays under REAL_MAX_KL
nats per answer. Rates, not the greedy answer: the base's own greedy France answer wins a near-tie ("The" 0.15
against "L" 0.14 for the first token) and 42 of its 64 sampled answers to that prompt have a fault, so a greedy
answer that flips measures the tie (docs/results/demo_real.md). The greedy answers' new faults are printed
beside. The KL is a guard for a model moved far: the runs whose answers broke wholesale measured 8.5-10.9 nats.

Each seed's directory is a normal demo workdir (`--stages` re-runs work there); `--stages` here passes through
(e.g. `--stages group_rl` re-runs only the RL stages on the seeds' SFT models). The table prints per seed, with
each row's 95 % interval, and the spread (min / mean / max) of every row over the seeds.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from run_demo import GROUP_RL_RUNS, REPO_ROOT

from aligner.config import run_main
from aligner.demo.instructions import new_general_faults
from aligner.demo.intervals import format_interval, rate_rose

TOY_MARGIN = 15.0  # points of held-out accuracy over the seed's SFT model, for every GRPO-family row
REAL_MARGIN = 20.0  # points of held-out prompts satisfied over the base, for RLOO and iterative DPO
REAL_MAX_KL = 8.0  # nats per general answer (see the module docstring)
DEMO = REPO_ROOT / "examples" / "demo"


def _run(command: list) -> None:
    print(f"\n### {' '.join(map(str, command))}", flush=True)
    if subprocess.run([str(part) for part in command], cwd=REPO_ROOT).returncode != 0:
        raise SystemExit(f"demo_seeds: {Path(str(command[1])).name} failed; its output is above")


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def toy(workdir: Path, seeds: list[int], stages: str) -> list[str]:
    rows = [("SFT", "sft")] + [(label, name) for name, label, _ in GROUP_RL_RUNS]
    results: dict[int, dict[str, dict]] = {}
    for seed in seeds:
        work = workdir / f"seed_{seed}"
        _run([sys.executable, DEMO / "run_demo.py", "--workdir", work, "--seed", seed, "--stages", stages])
        results[seed] = {label: _read(work / f"eval_{name}.json") for label, name in rows}
    failures = []

    def accuracy(result: dict) -> float:
        return 100 * result["all"]

    print("\nheld-out greedy accuracy [95 % interval] per seed (SFT seed = RL seed)")
    width = max(len(label) for label, _ in rows) + 2
    for seed, table in results.items():
        sft = accuracy(table["SFT"])
        print(f"seed {seed}:")
        for label, result in table.items():
            margin = accuracy(result) - sft
            verdict = "" if label == "SFT" else f"  {margin:+.1f}" + ("" if margin >= TOY_MARGIN else "  FAIL")
            interval = format_interval(result["all"], result["num_carry"] + result["num_no_carry"])
            print(f"  {label:<{width}}{interval:>24}  carry {100 * result['carry']:5.1f} %{verdict}")
            if label != "SFT" and margin < TOY_MARGIN:
                failures.append(f"seed {seed}: {label} {accuracy(result):.1f} % is {margin:+.1f} points over SFT "
                                f"({sft:.1f} %), under the {TOY_MARGIN:.0f} required")
    _spread(results, accuracy, "accuracy")
    return failures


def real(workdir: Path, seeds: list[int], stages: str, rloo_settings: tuple[str, ...] = ()) -> list[str]:
    first = workdir / f"seed_{seeds[0]}"
    shared = [stage for stage in ("model", "data", "base") if stage in stages.split(",")]
    if shared:  # the base and its evaluation do not depend on the seed: once, in the first seed's directory
        _run([sys.executable, DEMO / "run_demo_real.py", "--workdir", first, "--stages", ",".join(shared)])
    own = ",".join(stage for stage in stages.split(",") if stage not in shared) or "report"
    results: dict[int, dict[str, dict]] = {}
    for seed in seeds:
        work = workdir / f"seed_{seed}"
        if work != first:
            work.mkdir(parents=True, exist_ok=True)
            for name in ("base", "data"):  # read only by the later stages: linked, not copied (the base is ~0.5 GB)
                link = work / name
                if link.is_symlink() or link.is_file():
                    link.unlink()
                elif link.exists():
                    shutil.rmtree(link)
                link.symlink_to(first / name, target_is_directory=True)
            shutil.copy(first / "eval_base.json", work / "eval_base.json")
        _run([sys.executable, DEMO / "run_demo_real.py", "--workdir", work, "--seed", seed, "--stages", own,
              *[part for setting in rloo_settings for part in ("--rloo-set", setting)]])
        results[seed] = {name: _read(work / f"eval_{name}.json") for name in ("base", "rloo", "dpo")}
    failures = []

    def satisfied(result: dict) -> float:
        return 100 * result["prompt_level"]

    print("\nheld-out prompts satisfied [95 % interval] per seed")
    for seed, table in results.items():
        base = satisfied(table["base"])
        print(f"seed {seed}:")
        for name, result in table.items():
            france = next(item["response"] for item in result["general"] if "France" in item["prompt"][0]["content"])
            kl = result["kl_to_base"]
            print(f"  {name:<6}{format_interval(result['prompt_level'], result['prompts']):>24}  "
                  f"KL {round(kl, 2) + 0.0:5.2f}  words {result['mean_words']:5.1f}  France: {france!r}")
            if name == "base":
                continue
            margin = satisfied(result) - base
            if margin < REAL_MARGIN:
                failures.append(f"seed {seed}: {name} {satisfied(result):.1f} % is {margin:+.1f} points over the "
                                f"base ({base:.1f} %), under the {REAL_MARGIN:.0f} required")
            for fault in _greedy_faults(table["base"]["general"], result["general"]):
                print(f"    greedy: {fault}")
            for fault in _raised_fault_rates(table["base"], result):
                print(f"    {fault}")
                failures.append(f"seed {seed}: {name}'s {fault}")
            if kl > REAL_MAX_KL:
                failures.append(f"seed {seed}: {name}'s KL to the base on the general prompts, {kl:.2f} nats, is over "
                                f"the {REAL_MAX_KL:g} allowed")
    _spread(results, satisfied, "prompts satisfied")
    return failures


def _greedy_faults(base: list[dict], answers: list[dict]) -> list[str]:
    """One line per greedy general answer with a fault the base's greedy answer to the same prompt does not have."""
    broken = []
    for before, after in zip(base, answers):
        prompt = after["prompt"][0]["content"]
        new = new_general_faults(prompt, before["response"], after["response"])
        if new:
            broken.append(f"answer to {prompt!r} {'; '.join(new)}: {after['response']!r}")
    return broken


def _raised_fault_rates(base: dict, result: dict) -> list[str]:
    """One line per general prompt whose sampled answers have a fault significantly more often than the base's."""
    if "general_fault_counts" not in base or "general_fault_counts" not in result:
        raise SystemExit("demo_seeds: an evaluation has no general_fault_counts (made before they were measured): "
                         "re-run its evaluation (--stages base,rloo,dpo)")
    raised = []
    for before, after in zip(base["general_fault_counts"], result["general_fault_counts"]):
        if rate_rose(before["faulty"], before["samples"], after["faulty"], after["samples"]):
            raised.append(f"sampled answers to {after['prompt']!r} have a fault {after['faulty']}/{after['samples']} "
                          f"times, the base's {before['faulty']}/{before['samples']}")
    return raised


def _spread(results: dict[int, dict[str, dict]], figure, what: str) -> None:
    print(f"\n{what} over seeds {', '.join(map(str, results))}: min / mean / max")
    width = max(len(row) for row in next(iter(results.values()))) + 2
    for row in next(iter(results.values())):
        values = [figure(table[row]) for table in results.values()]
        print(f"  {row:<{width}}{min(values):6.1f} {sum(values) / len(values):6.1f} {max(values):6.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("demo", choices=("toy", "real"))
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds")
    parser.add_argument("--workdir", default=None, help="default: results/demo_seeds_<demo>")
    parser.add_argument("--stages", default=None,
                        help="passed to each seed's demo (default toy: sft,group_rl; real: model,data,base,rloo,dpo,"
                             "report)")
    parser.add_argument("--rloo-set", action="append", default=[], metavar="KEY=VALUE",
                        help="real: a setting for every seed's RLOO run after the demo's own (repeatable)")
    args = parser.parse_args()
    if args.rloo_set and args.demo != "real":
        parser.error("--rloo-set: only the real demo has an RLOO stage")
    try:
        seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: give comma-separated integers")
    if not seeds:
        parser.error("--seeds: give at least one seed")
    workdir = (REPO_ROOT / (args.workdir or f"results/demo_seeds_{args.demo}")).resolve()
    if args.demo == "toy":
        failures = toy(workdir, seeds, args.stages or "sft,group_rl")
    else:
        failures = real(workdir, seeds, args.stages or "model,data,base,rloo,dpo,report", tuple(args.rloo_set))
    if failures:
        print("\n" + "\n".join(failures))
        raise SystemExit(1)
    print(f"\nevery row kept its margin on seeds {', '.join(map(str, seeds))}")


if __name__ == "__main__":
    run_main(main)
