"""The group-baseline RL actor end to end (torchrun, gloo): the reward rises over a short RLOO run; DP=2
computes the same rollouts, rewards and GRPO advantages as DP=1 (a prompt's k samples stay together on
one rank); GRPO and GSPO's first minibatch has ratio 1 at TP=2, PP=2 and DP=2, and the native fp32
engine's logprobs match the trainer's."""
from __future__ import annotations

import json

import pytest

from ..conftest import REPO_ROOT, run_torchrun, train_tiny_arithmetic_policy

SCRIPT = REPO_ROOT / "tests" / "distributed" / "scripts" / "group_rl_step.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]
K = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("reinforce")
    policy, prompts = train_tiny_arithmetic_policy(root, seed=6)
    return root, policy, prompts


def _common(root, policy, prompts, name):
    return [f"model.init_from={policy}", f"data.prompts={prompts}", "data.max_prompt_length=8",
            "generation.max_new_tokens=5", f"rollout.samples_per_prompt={K}", "logging.progress_bar=false",
            "logging.tensorboard=false", "logging.peak_tflops=1.0", f"checkpoint.save_dir={root / name / 'ckpt'}",
            f"logging.log_dir={root / name}", "checkpoint.resume=false"]


def _step(root, policy, prompts, dp, router):
    name = f"step_dp{dp}_{router}"
    output = root / f"{name}.json"
    run_torchrun(SCRIPT, dp, "step", str(output), *_common(root, policy, prompts, name),
                 f"generation.router={router}", "generation.micro_batch_size=2", "rollout.prompts_per_step=8",
                 "trainer.global_batch_size=16", "trainer.micro_batch_size=4", "kl.init_coef=0.1",
                 "advantage.estimator=grpo")
    return json.loads(output.read_text())


def test_data_parallel_keeps_groups_together_and_gives_the_same_advantages(setup):
    root, policy, prompts = setup
    single = _step(root, policy, prompts, 1, "static")
    assert len(single["rows"]) == 8 * K
    for dp, router in ((2, "static"), (2, "dynamic")):
        double = _step(root, policy, prompts, dp, router)
        assert double["rows"].keys() == single["rows"].keys()
        for index, row in single["rows"].items():
            other = double["rows"][index]
            assert other["prompt"] == row["prompt"] and other["response"] == row["response"], index
            assert other["score"] == row["score"]
            assert other["reward"] == pytest.approx(row["reward"], abs=1e-5)
            assert other["advantage"] == pytest.approx(row["advantage"], abs=1e-4)
    rows = [single["rows"][str(i)] for i in range(8 * K)]
    groups = [rows[g * K:(g + 1) * K] for g in range(8)]
    assert all(len({tuple(r["prompt"]) for r in group}) == 1 for group in groups)  # k samples of one prompt
    # Each sample has its own random stream, also across micro-batches (2 rollouts each here): samples
    # j and j + 2 of a prompt sit at the same row of two micro-batches, and must not be copies.
    same = sum(group[j]["response"] == group[j + 2]["response"] for group in groups for j in range(2))
    assert same < 8
    # Group std normalisation: every group's advantages without the KL term have unit scale.
    assert any(abs(r["advantage"]) > 0.5 for r in rows)


def test_reward_rises_over_a_short_run(setup):
    root, policy, prompts = setup
    output = root / "fit.json"
    run_torchrun(SCRIPT, 1, "fit", str(output), *_common(root, policy, prompts, "fit"),
                 "generation.micro_batch_size=64", "rollout.prompts_per_step=16", "trainer.global_batch_size=64",
                 "trainer.micro_batch_size=64", "trainer.max_steps=12", "trainer.val_check_interval=0",
                 "optim.lr=3e-3", "kl.init_coef=0.0", "checkpoint.save_interval=0")
    steps = [m for m in json.loads(output.read_text()) if m["split"] == "train"]
    rewards = [m["reward_mean"] for m in steps]
    assert len(rewards) == 12
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.15, rewards
    assert all(m["first_ratio_mean"] == pytest.approx(1.0, abs=1e-6) for m in steps)
    assert "kl" not in steps[-1]  # kl.init_coef=0: no reference pass, so no KL to report


@pytest.mark.parametrize("tp, pp, dp, policy_loss, budget", [
    (2, 1, 1, "ppo_clip", None), (1, 2, 1, "ppo_clip", None), (1, 1, 2, "ppo_clip", None), (1, 1, 2, "gspo", None),
    (1, 1, 2, "ppo_clip", 24)])  # token-budget micro batches balanced across the two ranks
def test_grpo_first_minibatch_ratio_is_one_and_the_engine_matches_the_trainer(setup, tp, pp, dp, policy_loss, budget):
    root, policy, prompts = setup
    name = f"grpo_{tp}{pp}{dp}_{policy_loss}_{budget}"
    output = root / f"{name}.json"
    clip = ["loss.clip_ratio=3e-4", "loss.clip_high=4e-4"] if policy_loss == "gspo" else []
    run_torchrun(SCRIPT, tp * pp * dp, "step", str(output), *_common(root, policy, prompts, name),
                 f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
                 "generation.micro_batch_size=4", "rollout.prompts_per_step=4", "trainer.global_batch_size=8",
                 "trainer.micro_batch_size=2", "loss.epochs=2", "optim.lr=1e-2", "kl.init_coef=0.0",
                 "advantage.estimator=grpo", f"loss.policy_loss={policy_loss}", *clip,
                 *([f"packing.micro_batch_tokens={budget}"] if budget else []))
    metrics = json.loads(output.read_text())["metrics"]
    for key in ("first_ratio_mean", "first_ratio_max", "first_ratio_min"):
        assert metrics[key] == pytest.approx(1.0, abs=1e-6), key
    assert abs(metrics["first_approx_kl"]) < 1e-6
    assert metrics["ratio_max"] - metrics["ratio_min"] > 1e-4  # later minibatches moved: the check is not vacuous
    # The native engine samples in fp32 from the training weights: its logprobs are the trainer's.
    assert metrics["mismatch_kl"] < 1e-5
    assert metrics["mismatch_abs_logprob_diff_max"] < 1e-4


def test_episodes_on_two_data_parallel_ranks_are_the_single_process_episodes(setup):
    """Multi-turn episodes (the AddUp environment, two questions each): at DP=2 each rank runs its whole groups, and
    every episode's tokens, score and advantage equal the single-process run's (an episode's draws follow its
    position in the step, not its rank)."""
    root, policy, prompts = setup
    environment = [f"rollout.environment={REPO_ROOT / 'tests' / 'agent_envs.py'}:AddUp",
                   "rollout.environment_args={turns: 2}", "rollout.max_episode_tokens=40", "rollout.max_turns=2",
                   "rollout.sandbox.workers=8"]
    runs = {}
    for dp in (1, 2):
        name = f"episodes_dp{dp}"
        output = root / f"{name}.json"
        run_torchrun(SCRIPT, dp, "step", str(output), *_common(root, policy, prompts, name), *environment,
                     "generation.micro_batch_size=8", "rollout.prompts_per_step=4", "trainer.global_batch_size=16",
                     "trainer.micro_batch_size=4", "kl.init_coef=0.1", "advantage.estimator=grpo")
        runs[dp] = json.loads(output.read_text())
    single, double = runs[1], runs[2]
    assert len(single["rows"]) == 16 and double["rows"].keys() == single["rows"].keys()
    for index, row in single["rows"].items():
        other = double["rows"][index]
        assert other["prompt"] == row["prompt"] and other["response"] == row["response"], index
        assert other["score"] == row["score"] and other["advantage"] == pytest.approx(row["advantage"], abs=1e-4)
    assert single["metrics"]["episodes/turns"] == double["metrics"]["episodes/turns"] == 2.0
    tokens = "episodes/environment_tokens"
    assert double["metrics"][tokens] == pytest.approx(single["metrics"][tokens])
