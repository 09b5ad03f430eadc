"""aligner/launcher.py: the launcher's children and everything they started are gone after it stops them,
also when a child was killed and could not clean up after itself."""
from __future__ import annotations

import os
import re
import signal
import sys
import textwrap
import time

import psutil
import pytest

from aligner.launcher import READY_MARKER, ManagedProcess, run_processes

# A child that starts a grandchild (as torch.compile's worker pool does), prints the grandchild's
# pid, then behaves as argv[1] says: serve (print the ready line and wait) or exit with code 3.
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("grandchild", grandchild.pid, flush=True)
    if sys.argv[1] == "serve":
        print("%s 127.0.0.1:0" , flush=True)
        time.sleep(600)
    sys.exit(3)
""" % READY_MARKER)


def _grandchild_pid(process: ManagedProcess, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in process.log_path.read_text().splitlines() if process.log_path.exists() else []:
            if line.startswith("grandchild "):
                return int(line.split()[1])
        time.sleep(0.05)
    pytest.fail(f"{process.name} never reported its grandchild")


def _gone(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_stop_after_the_child_was_killed_removes_what_it_left_behind(tmp_path):
    child = ManagedProcess("actor", [sys.executable, "-c", PARENT, "serve"], tmp_path / "actor.log", echo=False)
    child.start(dict(os.environ))
    grandchild = _grandchild_pid(child)
    os.kill(child.process.pid, signal.SIGKILL)  # no chance to clean up: the grandchild is orphaned
    child.process.wait(timeout=30)
    assert psutil.pid_exists(grandchild) and not _gone(grandchild, timeout_s=0.5)
    child.stop()
    assert _gone(grandchild)


def test_run_processes_returns_the_actor_code_and_leaves_no_process(tmp_path):
    server = ManagedProcess("server", [sys.executable, "-c", PARENT, "serve"], tmp_path / "server.log", echo=False)
    actor = ManagedProcess("actor", [sys.executable, "-c", PARENT, "exit"], tmp_path / "actor.log", echo=False)
    code = run_processes([server], actor, ready_timeout_s=60)
    assert code == 3
    assert not server.running() and not actor.running()
    assert _gone(_grandchild_pid(server)) and _gone(_grandchild_pid(actor))


# ----------------------------------------------------------------------------- critic and actor batch sizes
ACTOR_REQUIRED = ["model.init_from=/sft", "data.prompts=p.jsonl"]


def _configs(critic_overrides=(), actor_overrides=()):
    from aligner.algorithms.rl_config import RLActorConfig
    from aligner.config import CONF_DIR, load_config
    from servers.critic import CriticServerConfig

    return (load_config(CriticServerConfig, CONF_DIR / "gpt_ppo_critic.yaml",
                        ["critic.init_from=/rm", *critic_overrides]),
            load_config(RLActorConfig, CONF_DIR / "gpt_ppo_actor.yaml", [*ACTOR_REQUIRED, *actor_overrides]))


def test_actor_rollouts_per_step_reads_the_actor_config():
    from aligner.launcher import actor_rollouts_per_step

    _, actor = _configs(actor_overrides=["rollout.prompts_per_step=48"])
    rollouts, key = actor_rollouts_per_step(actor)
    assert rollouts == 48 and key == "rollout.prompts_per_step x rollout.samples_per_prompt"


def _rollouts_key() -> str:
    """The actor key(s) the launcher names for the rollouts per step."""
    from aligner.launcher import actor_rollouts_per_step

    return re.escape(actor_rollouts_per_step(_configs(actor_overrides=["rollout.prompts_per_step=64"])[1])[1])


@pytest.mark.parametrize("critic_overrides, actor_overrides, critic_dp, message", [
    (["train.global_batch_size=48", "train.micro_batch_size=4"], ["rollout.prompts_per_step=64"], None,
     r"the critic's train.global_batch_size=48 must divide the actor's 64 rollouts per step \({key}\)"),
    (["train.global_batch_size=16", "server.max_train_rows=32"], ["rollout.prompts_per_step=64"], None,
     r"the actor's 64 rollouts per step \({key}\) are more than the critic's server.max_train_rows=32"),
    (["train.global_batch_size=16", "server.max_request_bytes=100000"],
     ["rollout.prompts_per_step=64", "data.max_prompt_length=100", "generation.max_new_tokens=60"], None,
     # 64 rows x (8 x 160 token columns + 8 x 60 response columns + 16) bytes
     r"up to data.max_prompt_length \+ generation.max_new_tokens = 160 tokens can carry 113664 bytes, more than the "
     r"critic's server.max_request_bytes=100000"),
    (["train.global_batch_size=16", "train.micro_batch_size=4"], ["rollout.prompts_per_step=64"], 8,
     r"train.global_batch_size \(16\) must be a multiple of train.micro_batch_size x data-parallel size = 4 x 8"),
])
def test_critic_that_would_reject_the_actors_batch_is_refused(critic_overrides, actor_overrides, critic_dp, message):
    from aligner.config import ConfigError
    from aligner.launcher import check_critic_fits_actor

    critic, actor = _configs(critic_overrides, actor_overrides)
    with pytest.raises(ConfigError, match=message.replace("{key}", _rollouts_key())):
        check_critic_fits_actor(critic, actor, critic_dp)


def test_critic_that_fits_the_actor_passes():
    from aligner.launcher import check_critic_fits_actor

    critic, actor = _configs(["train.global_batch_size=16", "train.micro_batch_size=4", "server.max_train_rows=64",
                              "server.max_request_bytes=113664"],
                             ["rollout.prompts_per_step=64", "data.max_prompt_length=100",
                              "generation.max_new_tokens=60"])
    check_critic_fits_actor(critic, actor, critic_data_parallel_size=4)
    check_critic_fits_actor(critic, actor)


def test_launch_ppo_refuses_a_batch_mismatch_before_starting_anything(tmp_path):
    """One line naming both keys, exit 2, and no process started (no log written)."""
    import subprocess

    from aligner.checkpointing import META_FILE

    from ..conftest import REPO_ROOT

    checkpoint = tmp_path / "rm"
    checkpoint.mkdir()
    (checkpoint / META_FILE).write_text("{}")  # a checkpoint by its paths (what is checked before the batches)
    log_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "nlp" / "gpt" / "launch_ppo.py"), "--reward-checkpoint",
         str(checkpoint), "--log-dir", str(log_dir), "--critic-arg=train.global_batch_size=24",
         "--critic-arg=train.micro_batch_size=4", *[f"--actor-arg={item}" for item in ACTOR_REQUIRED],
         "--actor-arg=rollout.prompts_per_step=64"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.fullmatch(r"error: the critic's train.global_batch_size=24 must divide the actor's 64 rollouts per step "
                        rf"\({_rollouts_key()}\): each critic_train request is one step's rollouts",
                        result.stderr.strip().splitlines()[-1]), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not log_dir.exists()
