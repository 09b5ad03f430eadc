"""Asynchronous RL at data-parallel size 2 through the entry point (torchrun, gloo): each rank's generation worker
makes the micro-batches the static router hands that rank, the ranks trade rows so each trains on its own share,
and the run equals the one-process asynchronous run; a checkpoint keeps both workers' outstanding rollouts and a
resume at DP=2 continues exactly."""
from __future__ import annotations

import shutil

import pytest

from ..conftest import REPO_ROOT, metrics_rows, run_torchrun
from ..tiny_actor import two_layer_policy_and_prompts

SCRIPT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_reinforce_actor.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]
UNTIMED = ("time_", "share_", "step_time", "rollout_tokens_per_second", "tokens_per_second", "mfu", "async/worker",
           "async/queue_depth")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, arithmetic_tokenizer_dir):
    return two_layer_policy_and_prompts(tmp_path_factory.mktemp("async_dp"), arithmetic_tokenizer_dir, 32)


def run(tiny, name: str, nproc: int, *settings: str, save_dir=None) -> list[dict]:
    """GRPO at max_staleness 1, 4 prompts x 4 samples a step in micro-batches of 4 (rank r's worker generates
    micro-batches r, r + 2: rows it then trades), one minibatch (the same update at DP=1 and 2); its train rows."""
    root, policy, prompts = tiny
    log_dir = root / name
    run_torchrun(SCRIPT, nproc, f"model.init_from={policy}", f"data.prompts={prompts}", "data.max_prompt_length=8",
                 "generation.max_new_tokens=6", "generation.micro_batch_size=4", "rollout.prompts_per_step=4",
                 "rollout.samples_per_prompt=4", "trainer.global_batch_size=16", "trainer.micro_batch_size=4",
                 "reward.source=function", "reward.function=tests.faults.errors_sft:ones_reward", "algorithm=grpo",
                 "optim.lr=3e-2", "kl.init_coef=0.05", "rollout.asynchronous.enabled=true",
                 "rollout.asynchronous.max_staleness=1", "rollout.asynchronous.worker_threads=1",
                 "loss.importance_sampling=token", "logging.progress_bar=false", "logging.tensorboard=false",
                 "logging.peak_tflops=1.0", f"checkpoint.save_dir={save_dir or log_dir / 'ckpt'}",
                 f"logging.log_dir={log_dir}", *settings)
    return metrics_rows(log_dir, "train")


def untimed(row: dict) -> dict:
    return {key: value for key, value in row.items() if not key.startswith(UNTIMED)}


def test_two_ranks_with_a_worker_each_train_as_one_process_and_resume_exactly(tiny):
    root = tiny[0]
    single = run(tiny, "single", 1, "trainer.max_steps=4", "checkpoint.save_interval=0")
    double = run(tiny, "double", 2, "trainer.max_steps=4", "checkpoint.save_interval=2")
    assert [row["async/staleness_max"] for row in double] == [0.0, 1.0, 1.0, 1.0]
    assert [row["async/staleness_mean"] for row in double] == [0.0, 1.0, 1.0, 1.0]
    for one, two in zip(single, double, strict=True):
        # the same rollouts (rewards, lengths) from the same weights; the update's sums in another order
        assert two["reward_mean"] == one["reward_mean"] and two["response_length"] == one["response_length"]
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-6)
        assert two["importance_weight_mean"] == pytest.approx(one["importance_weight_mean"], rel=1e-5)
    assert single[-1]["reward_mean"] != single[0]["reward_mean"]

    # Resumed at DP=2 from the checkpoint at step 2 (which holds step 3's rollouts, made by each rank's worker
    # with the weights of step 1): steps 3 and 4 as in the uninterrupted run.
    resumed_dir = root / "resumed_ckpt"
    resumed_dir.mkdir()
    shutil.copytree(root / "double" / "ckpt" / "step_00000002", resumed_dir / "step_00000002")
    resumed = run(tiny, "resumed", 2, "trainer.max_steps=4", "checkpoint.save_interval=0",
                  save_dir=resumed_dir)
    assert [row["step"] for row in resumed] == [3, 4]
    assert [untimed(row) for row in resumed] == [untimed(row) for row in double[2:]]
