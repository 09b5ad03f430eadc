"""A user's reward file in the working directory, through the RL entry point (a tiny random policy, one step):
named by its path and by its module name, reading the record's ground-truth column, two functions summed by
weight (one batched), each logged as reward/<name>; a function that fails on the probe record ends the run
with one line before the model is loaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ..conftest import REPO_ROOT
from ..tiny_actor import actor_settings, save_random_policy

REINFORCE_SCRIPT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_reinforce_actor.py"
ANSWERS = {"1+2=": "3", "3+4=": "7"}
MODEL_LOADED = "initialised from"  # the log line of the model's load

REWARD_FILE = textwrap.dedent("""
    import json

    def correct(prompt, response, answer):
        with open("calls.jsonl", "a") as out:
            out.write(json.dumps({"function": "correct", "prompt": prompt, "response": response,
                                  "answer": answer}) + "\\n")
        return float(answer)  # the ground truth itself: a reward that does not depend on what a random policy says

    def lengths(prompts, responses, answer):
        with open("calls.jsonl", "a") as out:
            out.write(json.dumps({"function": "lengths", "prompts": prompts, "responses": responses,
                                  "answer": answer}) + "\\n")
        return [float(len(response)) for response in responses]

    def needs_solution(prompt, response, solution):
        return 0.0
""")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, arithmetic_tokenizer_dir):
    """A working directory holding the user's reward file and prompts, and a policy saved elsewhere."""
    root = tmp_path_factory.mktemp("reward_files")
    policy = save_random_policy(root / "policy", arithmetic_tokenizer_dir, seed=5, num_layers=1, hidden_size=16,
                                num_attention_heads=2, num_query_groups=1, ffn_hidden_size=32)
    work = root / "work"
    work.mkdir()
    (work / "myreward.py").write_text(REWARD_FILE)
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": prompt, "answer": answer}) + "\n"
                                                for prompt, answer in ANSWERS.items()))
    return policy, work


def run_actor(policy, work, *settings: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REINFORCE_SCRIPT),
               *actor_settings(policy, work / "prompts.jsonl", work, "null"), "trainer.max_steps=1", *settings]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=work, env=env)


def test_a_reward_file_by_path_and_by_module_reads_the_ground_truth_summed_by_weight(workdir):
    policy, work = workdir
    result = run_actor(policy, work, "reward.functions=[{function: myreward.py:correct, weight: 2.0}, "
                                     "{function: myreward:lengths, weight: 0.5, batched: true}]")
    assert result.returncode == 0, result.stderr[-3000:]
    calls = [json.loads(line) for line in (work / "calls.jsonl").read_text().splitlines()]
    # The probe: each function once on the first record with the response "", before the model loads
    assert calls[:2] == [{"function": "correct", "prompt": "1+2=", "response": "", "answer": "3"},
                         {"function": "lengths", "prompts": ["1+2="], "responses": [""], "answer": ["3"]}]
    correct = [call for call in calls[2:] if call["function"] == "correct"]
    batches = [call for call in calls[2:] if call["function"] == "lengths"]
    assert len(correct) == 4 and all(call["answer"] == ANSWERS[call["prompt"]] for call in correct)
    assert len(batches) == 1 and batches[0]["answer"] == [ANSWERS[prompt] for prompt in batches[0]["prompts"]]
    assert sorted(batches[0]["responses"]) == sorted(call["response"] for call in correct)

    metrics = json.loads((work / "logs" / "metrics.jsonl").read_text().splitlines()[0])
    mean_answer = sum(float(call["answer"]) for call in correct) / 4  # float64 reference
    mean_length = sum(len(response) for response in batches[0]["responses"]) / 4
    assert metrics["reward/correct"] == pytest.approx(mean_answer, abs=1e-6)
    assert metrics["reward/lengths"] == pytest.approx(mean_length, abs=1e-6)
    assert metrics["reward_mean"] == pytest.approx(2.0 * mean_answer + 0.5 * mean_length, abs=1e-5)


def test_a_reward_module_in_the_working_directory_that_fails_on_the_probe_stops_before_the_model(workdir):
    policy, work = workdir
    result = run_actor(policy, work, "reward.function=myreward:needs_solution")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == (
        f"error: reward function myreward:needs_solution takes the column 'solution', but the record of the prompt "
        f"at {work / 'prompts.jsonl'}:1 (the probe before the model loads: the first prompt record, with the "
        f'response "") has none (its columns: answer)')
    assert MODEL_LOADED not in result.stdout + result.stderr
