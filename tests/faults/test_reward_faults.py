"""A reward function that never returns, in whole processes: SIGTERM to the RL actor (its real entry point)
while it waits on one stops it within seconds with one line and no process left; a call past
reward.timeout_s ends the process with one error line although the thread running it cannot be stopped.
(What the actor does with each kind of bad score is in tests/unit/test_rewards.py.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from aligner.generation.rewards import STOP_PATIENCE_S

from ..conftest import REPO_ROOT, processes_alive
from ..tiny_actor import MESSAGES_LINE, actor_settings, write_tiny_policy

REINFORCE_SCRIPT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_reinforce_actor.py"
STARTED = "ALIGNER_TEST_REWARD_STARTED"  # the file a hanging call creates once it hangs


def hanging_reward(prompt, response_text: str) -> float:
    """Hangs on the conversation prompt (forever: only the process's end stops it)."""
    if isinstance(prompt, list):
        if os.environ.get(STARTED):
            Path(os.environ[STARTED]).touch()
        threading.Event().wait()
    return 0.0


def _env(**extra: str) -> dict:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **extra,
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory, arithmetic_tokenizer_dir):
    root = tmp_path_factory.mktemp("reward_faults")
    return write_tiny_policy(root, arithmetic_tokenizer_dir)


def test_sigterm_while_a_reward_call_hangs_stops_the_actor_within_seconds(tiny_policy, tmp_path):
    policy, prompts = tiny_policy
    started = tmp_path / "started"
    command = [sys.executable, str(REINFORCE_SCRIPT),
               *actor_settings(policy, prompts, tmp_path, "tests.faults.test_reward_faults:hanging_reward"),
               "trainer.max_steps=3"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                               env=_env(**{STARTED: str(started)}))
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), process.communicate(timeout=30)[1][-3000:]
        family = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)  # not stop_grace_s (600 s)
        took = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert took < STOP_PATIENCE_S + 10, took
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("stopped after step 0 by SIGTERM without a checkpoint: the reward function "
                           "tests.faults.test_reward_faults:hanging_reward (its call for the prompt at "
                           f"{prompts}:{MESSAGES_LINE} running for "), last
    assert last.endswith(f"sent no score for {STOP_PATIENCE_S:g} s after the signal; resume with the same command "
                         "(from the previous checkpoint)"), last
    assert processes_alive(family, timeout_s=5) == []


def test_a_call_past_the_timeout_ends_the_process_with_one_line():
    """The hung call's thread is still running when the error ends the process: it must not keep it alive."""
    code = textwrap.dedent("""
        from aligner.config import run_main
        from aligner.generation.rewards import RewardChecks, RuleRewardSource

        def main():
            source = RuleRewardSource("tests.faults.test_reward_faults:hanging_reward", RewardChecks(timeout_s=0.5))
            source.score_async([[1, 2]], [[{"role": "user", "content": "5+6="}]], ["11"], ["prompts.jsonl:7"]).result()

        run_main(main)
    """)
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
                            env=_env())
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == ("error: reward function tests.faults.test_reward_faults:hanging_reward did not "
                                     "return within reward.timeout_s=0.5 s for the prompt at prompts.jsonl:7 (raise "
                                     "reward.timeout_s if its calls take that long)")
    assert time.monotonic() - start < 30
