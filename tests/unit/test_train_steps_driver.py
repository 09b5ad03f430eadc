"""benchmarks/train_steps.py's driver: the turn-taking protocol, the ratio, and one source of equal-work settings.

The workers here are tiny python processes that sleep known amounts; no TRL, no model.
"""
import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from aligner.config import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from peer import workload  # noqa: E402
from peer.protocol import Worker, WorkerError, run_interleaved, step_ratio  # noqa: E402
from train_steps import make_workers, print_waterfall, trend, unequal_work, worker_environment  # noqa: E402

FAKE_WORKER = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {benchmarks!r})
    from peer.protocol import serve_steps
    seconds, tokens, journal = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]

    def step():
        with open(journal, "a") as out:
            out.write(json.dumps(["start", {name!r}, time.time()]) + "\\n")
        time.sleep(seconds)
        with open(journal, "a") as out:
            out.write(json.dumps(["end", {name!r}, time.time()]) + "\\n")
        return (tokens, {{"share_sleep": 0.75}}) if {name!r} == "ours" else tokens

    serve_steps(step)
""")


def fake_worker(tmp_path: Path, name: str, seconds: float, tokens: float, journal: Path) -> Worker:
    script = tmp_path / f"fake_{name}.py"
    script.write_text(FAKE_WORKER.format(benchmarks=str(REPO_ROOT / "benchmarks"), name=name))
    command = [sys.executable, str(script), str(seconds), str(tokens), str(journal)]
    return Worker(name, command, tmp_path / f"{name}.log")


def test_workers_take_turns_and_report_their_own_step_times(tmp_path):
    journal = tmp_path / "journal.jsonl"
    ours = fake_worker(tmp_path, "ours", 0.05, 100, journal)
    peer = fake_worker(tmp_path, "peer", 0.15, 200, journal)
    our_result, peer_result = run_interleaved([ours, peer], total_steps=4)

    assert len(our_result.seconds) == len(peer_result.seconds) == 4
    assert our_result.tokens == [100.0] * 4 and peer_result.tokens == [200.0] * 4
    # figures a worker reports about its steps arrive per step, after the two the protocol counts for every
    # worker: its minor page faults and CPU seconds (a sleeping step uses little of either)
    assert [step["share_sleep"] for step in our_result.figures] == [0.75] * 4
    for result in (our_result, peer_result):
        assert all(set(step) - {"share_sleep"} == {"minor_faults", "cpu_seconds"} for step in result.figures)
        assert all(0 <= step["minor_faults"] < 5000 and 0 <= step["cpu_seconds"] < 0.05 for step in result.figures)
    # A step's reported time is the worker's own step: at least its sleep, and inside its own start..end
    # in the journal (so never the other side's turn). No upper bound on a sleep: the machine may be loaded.
    assert all(s >= 0.05 for s in our_result.seconds) and all(s >= 0.15 for s in peer_result.seconds)
    assert our_result.peak_rss_mb > 0 and peer_result.peak_rss_mb > 0
    # Only one computes at a time, and the side that goes first alternates step by step.
    events = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [kind for kind, _, _ in events] == ["start", "end"] * 8
    starts = [name for kind, name, _ in events if kind == "start"]
    assert starts == ["ours", "peer", "peer", "ours", "ours", "peer", "peer", "ours"]
    assert all(events[i][2] <= events[i + 1][2] for i in range(len(events) - 1))
    spans = {"ours": [], "peer": []}
    for (_, name, start), (_, _, end) in zip(events[::2], events[1::2]):
        spans[name].append(end - start)
    for name, result in (("ours", our_result), ("peer", peer_result)):
        assert all(span <= seconds + 1e-3 for span, seconds in zip(spans[name], result.seconds)), name
        assert all(seconds < span + 0.5 for span, seconds in zip(spans[name], result.seconds)), name


def test_step_ratio_is_the_median_of_per_step_ratios_after_the_warmup():
    peer = [100.0, 4.0, 9.0, 2.0, 30.0]
    ours = [1.0, 2.0, 3.0, 2.0, 10.0]  # per-step ratios after the warm-up step: 2, 3, 1, 3
    assert step_ratio(peer, ours, warmup_steps=1) == 2.5
    assert step_ratio(peer, ours, warmup_steps=2) == 3.0
    with pytest.raises(ValueError):
        step_ratio(peer, ours, warmup_steps=5)


def test_a_worker_that_dies_is_reported_with_its_log(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text("import sys\nprint('building failed: no such model')\nsys.exit(3)\n")
    ours = fake_worker(tmp_path, "ours", 0.01, 1, tmp_path / "journal.jsonl")
    started = time.perf_counter()
    with pytest.raises(WorkerError, match=r"(?s)dies worker .*exit 3.*building failed: no such model"):
        run_interleaved([ours, Worker("dies", [sys.executable, str(script)], tmp_path / "dies.log")], total_steps=2)
    assert time.perf_counter() - started < 30
    assert ours.process.poll() is not None  # the other side is not left running


def test_both_sides_settings_come_from_one_workload(tmp_path):
    """Change every matched setting in the Workload: each side's config must follow."""
    for task, toy in itertools.product(workload.TASKS, (False, True)):
        base = workload.default_workload(task, steps=3, warmup_steps=1, toy=toy)
        work = dataclasses.replace(base, steps=5, warmup_steps=2, global_batch_size=base.micro_batch_size * 3,
                                   max_seq_length=base.max_seq_length + 8, lr=3.5e-5, seed=77, dpo_beta=0.25,
                                   prompts_per_step=base.micro_batch_size, samples_per_prompt=3,
                                   max_new_tokens=24, threads=3)
        yaml_name, overrides = workload.aligner_overrides(work, tmp_path / "ckpt", tmp_path / "data.jsonl", tmp_path)
        ours = dict(override.split("=", 1) for override in overrides)
        trainer_name, peer = workload.trl_config(work, tmp_path / "trl")

        assert ours["trainer.max_steps"] == "7" and peer["max_steps"] == 7
        assert float(ours["optim.lr"]) == peer["learning_rate"] == 3.5e-5
        assert ours["seed"] == "77" and peer["seed"] == 77
        assert int(ours["trainer.micro_batch_size"]) == peer["per_device_train_batch_size"]
        assert (int(ours["trainer.global_batch_size"])
                == peer["per_device_train_batch_size"] * peer["gradient_accumulation_steps"])
        assert float(ours["optim.clip_grad"]) == peer["max_grad_norm"]
        assert ours["precision"] == "fp32" and peer["bf16"] is False and peer["fp16"] is False
        assert peer["gradient_checkpointing"] is False
        if task in ("sft", "dpo"):
            assert int(ours["data.max_seq_length"]) == peer["max_length"] == base.max_seq_length + 8
        if task == "dpo":
            assert float(ours["dpo.beta"]) == peer["beta"] == 0.25
            # both sides run the reference forward inside every step
            assert ours["dpo.reference_logprobs"] == "swap" and peer["precompute_ref_log_probs"] is False
        if task == "grpo":  # both take the rollout policy's logprobs from the update's forward
            assert trainer_name == "GRPOTrainer" and ours["advantage.estimator"] == "grpo"
            assert peer["scale_rewards"] == "group" and peer["loss_type"] == "dapo"
        if task == "rl":
            assert trainer_name == "RLOOTrainer" and ours["advantage.estimator"] == "rloo"
        if task in workload.RL_TASKS:
            assert int(ours["rollout.samples_per_prompt"]) == peer["num_generations"] == 3
            assert (int(ours["generation.max_new_tokens"]) == int(ours["generation.min_new_tokens"])
                    == peer["max_completion_length"] == peer["generation_kwargs"]["min_new_tokens"] == 24)
            # TRL generates per_device x gradient accumulation responses per optimizer step: one per rollout step
            assert (int(ours["rollout.prompts_per_step"]) * 3 == int(ours["trainer.global_batch_size"])
                    == peer["per_device_train_batch_size"] * peer["gradient_accumulation_steps"])
            assert float(ours["kl.init_coef"]) == peer["beta"] == 0.0
            assert ours["reward.function"] == work.reward_function
            # the same micro steps: one pass over the rollouts, in micro batches of the same size; TRL's
            # steps_per_generation left to its default (the gradient accumulation steps)
            assert int(ours["loss.epochs"]) == peer["num_iterations"] == 1 and "steps_per_generation" not in peer
        if task == "sft":  # the loss on the completion only, on both sides (the data is prompt/completion)
            assert peer["completion_only_loss"] is True and peer["assistant_only_loss"] is False


def test_an_rl_workload_trains_once_per_rollout_step():
    with pytest.raises(ValueError, match="one optimizer step per rollout step"):
        dataclasses.replace(workload.default_workload("rl", steps=2), prompts_per_step=4)


def test_the_reward_is_the_same_function_in_both_forms():
    from aligner.generation.rewards import load_function

    prompts = [[{"role": "user", "content": "q"}]] * 3
    completions = [[{"role": "assistant", "content": text}] for text in ("aei", "xyz!", "bab")]
    vowel_share = load_function(workload.REWARD_FUNCTIONS["filler"])  # as our actor loads it
    assert workload.trl_reward(vowel_share)(prompts, completions) == pytest.approx([1.0, 0.0, 1 / 3])
    score = load_function(workload.REWARD_FUNCTIONS["arithmetic"])
    prompts = [[{"role": "user", "content": "12+7="}]] * 2
    completions = [[{"role": "assistant", "content": answer}] for answer in ("19", "18")]
    assert workload.trl_reward(score)(prompts, completions) == [score(p, c[0]["content"]) for p, c in
                                                                zip(prompts, completions)]
    assert workload.trl_reward(score)(prompts, completions)[0] > workload.trl_reward(score)(prompts, completions)[1]


def test_the_data_is_one_file_in_the_conversational_form(tmp_path):
    for task, toy in itertools.product(workload.TASKS, (False, True)):
        work = workload.default_workload(task, steps=2, warmup_steps=1, toy=toy)
        records = [json.loads(line) for line in workload.write_data(work, tmp_path / f"{task}{toy}").read_text()
                   .splitlines()]
        per_step = work.prompts_per_step if task in workload.RL_TASKS else work.global_batch_size
        assert len(records) >= work.total_steps * per_step
        key = {"sft": "completion", "dpo": "chosen", "rl": "prompt", "grpo": "prompt"}[task]
        assert all(isinstance(record[key], list) and record[key][0]["content"] for record in records)


ALLOCATE_AND_FREE = textwrap.dedent("""
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    def resident_kib():
        return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmRSS")))
    before = resident_kib()
    block = libc.malloc(256 * 2**20)
    ctypes.memset(block, 1, 256 * 2**20)
    libc.free(ctypes.c_void_p(block))
    print(resident_kib() - before)
""")


def test_both_sides_get_the_allocator_settings_our_process_makes_for_itself():
    """The peer's worker gets our process's glibc malloc settings through GLIBC_TUNABLES: a freed 256 MiB block
    stays resident (no mmap, no trim), as in our process after `cpu_bridge.reuse_freed_memory`; without them
    glibc hands it back to the kernel. (The environment is one dict, given to both workers.)"""
    from aligner.runtime import cpu_bridge

    env = worker_environment(3)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3"
    assert env["GLIBC_TUNABLES"] == (f"glibc.malloc.mmap_max={cpu_bridge.MALLOC_MMAP_MAX}:"
                                     f"glibc.malloc.trim_threshold={cpu_bridge.MALLOC_TRIM_THRESHOLD}")

    def kept_kib(tunables: str | None, setup: str = "") -> int:
        """KiB still resident after a 256 MiB block is written and freed, in a new process."""
        child = {name: value for name, value in os.environ.items() if name != "GLIBC_TUNABLES"}
        if tunables is not None:
            child["GLIBC_TUNABLES"] = tunables
        run = subprocess.run([sys.executable, "-c", setup + ALLOCATE_AND_FREE], capture_output=True, text=True,
                             env=child, check=True)
        return int(run.stdout.split()[-1])

    assert kept_kib(env["GLIBC_TUNABLES"]) > 200 * 1024  # the peer's process, given the environment
    assert kept_kib(None, "from aligner.runtime import cpu_bridge\nassert cpu_bridge.reuse_freed_memory()\n") \
        > 200 * 1024  # ours, by its own call
    assert kept_kib(None) < 16 * 1024  # glibc's defaults: an mmap'd block, given back at free


def test_a_side_still_speeding_up_is_flagged():
    assert trend([1.0, 1.0, 1.02, 0.99, 1.0, 1.01]) is None  # settled
    assert trend([2.0, 1.9, 1.8, 1.5, 1.4, 1.3]) == pytest.approx(1.4 / 1.9 - 1.0)  # still falling: flagged
    assert trend([1.0, 2.0, 3.0]) is None  # too few to tell


VARIANT_WORKER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {benchmarks!r})
    from peer.protocol import serve_steps
    journal = sys.argv[1]

    def step(variant=None):
        with open(journal, "a") as out:
            out.write(json.dumps(variant) + "\\n")
        return 10.0, {{"n": float(len(variant or ""))}}

    serve_steps(step)
""")


def test_a_worker_with_variants_steps_each_of_them_once_a_round(tmp_path):
    """The waterfall's protocol: "step VARIANT" reaches the worker's step(variant); a round steps every variant
    and the peer once, in an order that reverses every other round; one result per variant, named by it."""
    script = tmp_path / "variants.py"
    script.write_text(VARIANT_WORKER.format(benchmarks=str(REPO_ROOT / "benchmarks")))
    journal = tmp_path / "journal.jsonl"
    ours = Worker("ours", [sys.executable, str(script), str(journal)], tmp_path / "ours.log", variants=("a", "bb"))
    peer = fake_worker(tmp_path, "peer", 0.01, 5, tmp_path / "peer_journal.jsonl")
    results = run_interleaved([ours, peer], total_steps=3)
    assert [result.name for result in results] == ["ours:a", "ours:bb", "peer"]
    assert [json.loads(line) for line in journal.read_text().splitlines()] == ["a", "bb", "bb", "a", "a", "bb"]
    assert [step["n"] for step in results[0].figures] == [1.0] * 3 and [step["n"] for step in results[1].figures] \
        == [2.0] * 3
    assert results[0].peak_rss_mb == results[1].peak_rss_mb > 0  # one process behind both


def test_both_workers_get_one_environment_workload_and_data_and_ours_the_waterfall(tmp_path):
    """A later change cannot give the peer other settings: the two Workers share the environment (allocator,
    threads), the workload file and the data file; ours alone carries the waterfall's variants."""
    resolved = SimpleNamespace(checkpoint_dir=tmp_path / "ckpt", hf_dir=tmp_path / "hf")
    for task in workload.TASKS:
        work = workload.default_workload(task, steps=10, warmup_steps=3)
        paths = (tmp_path / "work.json", resolved, tmp_path / "python", tmp_path / "data.jsonl", tmp_path)
        ours, peer = make_workers(work, *paths, with_waterfall=True)
        assert ours.env == peer.env == worker_environment(work.threads) and ours.env is not peer.env
        assert ours.command[2:4] == [str(tmp_path / "work.json"), str(resolved.checkpoint_dir)]
        assert peer.command[2:4] == [str(tmp_path / "work.json"), str(resolved.hf_dir)]
        assert ours.command[4] == peer.command[4] == str(tmp_path / "data.jsonl")
        assert ours.variants == workload.waterfall(task) and peer.variants == ()
        assert make_workers(work, *paths, with_waterfall=False)[0].variants == ()


def test_the_sft_data_puts_the_loss_on_the_completion_only(tmp_path):
    """Our side's loss mask on the benchmark's SFT records: zero over the prompt (and its template), one over the
    completion to the cut; TRL's completion_only_loss masks the same prompt (checked per step at run time:
    both workers report the positions their loss reads)."""
    from aligner.data.sft import SFTDataset

    from ..chat_tokenizers import build_chat_tokenizer

    tokenizer = build_chat_tokenizer(tmp_path / "tokenizer", "smollm2")
    work = workload.default_workload("sft", steps=1, warmup_steps=0)
    dataset = SFTDataset(workload.write_data(work, tmp_path), tokenizer, work.max_seq_length)
    for index in range(3):
        mask = dataset[index]["loss_mask"].tolist()
        first = mask.index(1)
        assert len(mask) == work.max_seq_length and set(mask[:first]) == {0} and set(mask[first:]) == {1}
        assert first > 60  # the prompt (60 words and the template) is not trained on


def test_unequal_micro_steps_or_loss_positions_are_flagged():
    counts = {"train_slots": 1024.0, "train_lm_positions": 700.0, "train_micro_steps": 2.0, "nograd_slots": 0.0,
              "nograd_lm_positions": 0.0}
    assert unequal_work(counts, dict(counts)) == []
    assert unequal_work({**counts, "loss_positions": 700.0}, {**counts, "loss_positions": 700.0}) == []
    # a token per row at the prompt/completion seam (TRL tokenizes the two together): within the tolerance
    assert unequal_work({**counts, "loss_positions": 661.0}, {**counts, "loss_positions": 663.0}) == []
    flags = unequal_work({**counts, "loss_positions": 700.0}, {**counts, "train_micro_steps": 4.0,
                                                                 "loss_positions": 1020.0})
    assert flags == ["unequal micro steps: ours 2, TRL 4 training forwards per step",
                     "unequal loss positions: ours 700, TRL 1020 per step"]


def test_the_waterfall_switches_the_shortcuts_on_one_by_one_and_its_factors_multiply(capsys):
    assert workload.waterfall("sft") == ("none", "products", "products+logits_at_positions")
    assert workload.waterfall("grpo")[-1] == "+".join(workload.SHORTCUTS)
    assert workload.shortcuts_of("none") == frozenset()
    assert workload.shortcuts_of("products+shared_prompts") == {"products", "shared_prompts"}
    with pytest.raises(ValueError, match="no shortcut"):
        workload.shortcuts_of("products+fast_mode")
    figures = {"body_params": 1e8, "head_params": 3e7, "train_slots": 1000.0, "train_lm_positions": 100.0,
               "nograd_slots": 500.0, "nograd_lm_positions": 50.0, "train_micro_steps": 2.0}
    assert workload.flop_estimate(figures) == 6 * (1e11 + 3e9) + 2 * (5e10 + 1.5e9)

    def side(name, seconds):
        return SimpleNamespace(name=name, seconds=seconds, figures=[figures])

    # one warm-up round, then two timed rounds: TRL 8 s; ours without shortcuts 4 s, with products 2 s, all 1 s
    results = [side("ours:none", [9, 4, 4]), side("ours:products", [9, 2, 2]),
               side("ours:products+logits_at_positions", [9, 1, 1])]
    print_waterfall("sft", side("trl", [9, 8, 8]), results, warmup_steps=1)
    factors = [float(word[1:]) for word in capsys.readouterr().out.split() if word.startswith("x")]
    assert factors == [2.0, 2.0, 2.0] and math.prod(factors) == 8.0  # = TRL / ours
