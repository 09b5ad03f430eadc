"""The RL actor on multi-turn episodes (rollout.environment / rollout.tools), built by build_rl_actor: the same step
as single-turn when the environment answers once, episodes of several turns trained on the model's tokens only,
tool calls counted, the bad-call policy's fixed advantage, and the settings refused in one line."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from aligner.algorithms.rl_config import RLActorConfig
from aligner.config import CONF_DIR, ConfigError, load_config
from aligner.training.microbatch_plan import SequenceRows

GROUP_YAML = CONF_DIR / "gpt_reinforce_actor.yaml"
ENVIRONMENTS = Path(__file__).resolve().parents[1] / "agent_envs.py"
# Keys that differ between two runs of the same step: wall-clock timings and the episode-only metrics.
UNTIMED = ("time_", "share_", "step_time", "rollout_tokens_per_second", "tokens_per_second", "mfu", "episodes/")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, arithmetic_tokenizer_dir):
    """A random-init 2-layer policy on the demo's character tokenizer and 16 demo prompts."""
    from ..tiny_actor import two_layer_policy_and_prompts

    return two_layer_policy_and_prompts(tmp_path_factory.mktemp("agent_actor"), arithmetic_tokenizer_dir, 16)


def actor_config(tiny, name: str, *settings: str) -> RLActorConfig:
    """GRPO on the tiny policy: 4 prompts x 4 samples in one generation call, one minibatch, the ones reward."""
    root, policy, prompts = tiny
    return load_config(RLActorConfig, GROUP_YAML, [
        f"model.init_from={policy}", f"data.prompts={prompts}", "data.max_prompt_length=8",
        "generation.max_new_tokens=4", "generation.micro_batch_size=16", "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4", "trainer.global_batch_size=16", "trainer.micro_batch_size=8",
        "reward.source=function", "reward.function=tests.faults.errors_sft:ones_reward", "algorithm=grpo",
        "optim.lr=1e-2", "kl.init_coef=0.05", "logging.progress_bar=false", "logging.tensorboard=false",
        "logging.peak_tflops=1.0", f"checkpoint.save_dir={root / name / 'ckpt'}", f"logging.log_dir={root / name}",
        "checkpoint.resume=false", "rollout.sandbox.workers=16", *settings])


def run_steps(cfg: RLActorConfig, steps: int = 1):
    from aligner.algorithms.rl_build import build_rl_actor

    trainer = build_rl_actor(cfg)
    try:
        return trainer, [trainer.train_step() for _ in range(steps)]
    finally:
        trainer.rollouts.close()
        trainer.metrics.close()


def untimed(metrics: dict) -> dict:
    return {key: value for key, value in metrics.items() if not key.startswith(UNTIMED) and key not in UNTIMED}


def test_an_environment_that_answers_once_gives_the_single_turn_steps_bit_for_bit(single_process, tiny):
    """Single-turn rollouts are episodes of one model segment: two steps through a one-turn environment (its
    episodes scored by the same reward function, rows of the same length) give exactly the single-turn steps'
    rollouts, scores, advantages, metrics and weights. The reported loss and entropy alone may differ in their last
    bits: an episode row's per-token tensors are max_episode_tokens - 1 wide (4 in the single-turn run), and the mean
    of the same terms over a wider zero-padded tensor rounds in another order (the gradient, hence the weights,
    does not)."""
    single, single_metrics = run_steps(actor_config(tiny, "single"), steps=2)
    episodes, episode_metrics = run_steps(actor_config(tiny, "one_turn", f"rollout.environment={ENVIRONMENTS}:OneTurn",
                                                       "rollout.max_episode_tokens=12"), steps=2)
    for step in range(2):
        assert episode_metrics[step]["episodes/done"] == 1.0 and episode_metrics[step]["episodes/turns"] == 1.0
        reported = ("loss", "policy_loss", "entropy")
        for key in reported:
            assert episode_metrics[step][key] == pytest.approx(single_metrics[step][key], rel=1e-6, abs=1e-9), key
        assert ({k: v for k, v in untimed(episode_metrics[step]).items() if k not in reported}
                == {k: v for k, v in untimed(single_metrics[step]).items() if k not in reported})
    for (name, a), (_, b) in zip(single.chunks[0].named_parameters(), episodes.chunks[0].named_parameters()):
        assert torch.equal(a, b), name


def test_grpo_on_episodes_of_several_turns_trains_on_the_model_tokens(single_process, tiny):
    """Two questions per episode (environment_args reach the environment), rewards from it: every episode plays
    both turns, the batch trains only the model's tokens (the environment's questions are masked out), the first
    minibatch has ratio 1."""
    cfg = actor_config(tiny, "add_up", f"rollout.environment={ENVIRONMENTS}:AddUp",
                       "rollout.environment_args={turns: 2}",
                       "reward.source=environment", "rollout.max_episode_tokens=48", "rollout.max_turns=3",
                       "generation.max_new_tokens=3")
    from aligner.algorithms.rl_build import build_rl_actor

    trainer = build_rl_actor(cfg)
    try:
        batch, metrics = trainer.rollouts.collect(7, {}, policy_version=0)
        step = trainer.train_step()
    finally:
        trainer.rollouts.close()
        trainer.metrics.close()
    assert len(batch.rows) == 16 and batch.tokens.shape[1] == 48
    for b, row in enumerate(batch.rows):
        episode_mask = row.loss_mask if row.loss_mask is not None else torch.ones(len(row.response), dtype=torch.bool)
        assert torch.equal(batch.mask[b, :len(row.response)], episode_mask)
        assert not batch.mask[b, len(row.response):].any()
        assert 0.0 <= row.score <= 1.0
    assert metrics["episodes/done"] == 1.0 and metrics["episodes/turns"] == 2.0  # max_turns=3: the game ended them
    assert metrics["episodes/environment_tokens"] > 0
    assert int(batch.mask.sum()) == round(metrics["episodes/model_tokens"] * 16)  # trained tokens = model tokens
    assert step["first_ratio_max"] == pytest.approx(1.0, abs=1e-6) and math.isfinite(step["loss"])
    assert "kl" in step and "episodes/turns" in step


@pytest.mark.parametrize("settings, message", [
    (("algorithm=ppo", "reward.source=combined"), "scores single-turn rollouts"),
    (("rollout.dynamic_sampling=true",), "single-turn rollouts only"),
    (("parallel.tensor_model_parallel_size=2",), "tensor and pipeline parallel size 1"),
    (("rollout.max_episode_tokens=8",), "must exceed data.max_prompt_length=8"),
    (("rollout.tools=[calculator]",), "both set"),
])
def test_settings_episodes_cannot_run_are_refused_with_the_key_named(tiny, settings, message):
    cfg = actor_config(tiny, "refused", f"rollout.environment={ENVIRONMENTS}:OneTurn", *settings)
    with pytest.raises(ConfigError, match=message):
        cfg.validate(data_parallel_size=1)


def test_reward_source_environment_needs_episodes(tiny):
    with pytest.raises(ConfigError, match="reward.source=environment takes the rewards"):
        actor_config(tiny, "no_env", "reward.source=environment").validate(data_parallel_size=1)


def test_an_environment_that_cannot_load_is_one_line_naming_the_key(single_process, tiny):
    cfg = actor_config(tiny, "missing", f"rollout.environment={ENVIRONMENTS}:NoSuchClass",
                       "rollout.max_episode_tokens=40")
    from aligner.algorithms.rl_build import build_rl_actor

    with pytest.raises(ConfigError, match=r"rollout.environment=.*NoSuchClass"):
        build_rl_actor(cfg)


def test_a_run_stopped_after_a_step_resumes_to_the_uninterrupted_runs_weights(single_process, tiny):
    """Two steps of episodes in one go, and one step, a checkpoint, a new actor resumed from it and the second
    step: the same weights (the prompt order, the step's sampling seeds and the replacement draws resume)."""
    from aligner.algorithms.rl_build import build_rl_actor

    episodes = (f"rollout.environment={ENVIRONMENTS}:AddUp", "reward.source=environment",
                "rollout.max_episode_tokens=48",
                "rollout.max_turns=3", "generation.max_new_tokens=3")

    def fit(name: str, steps: int, resume: bool):
        cfg = actor_config(tiny, name, *episodes, f"trainer.max_steps={steps}", f"checkpoint.resume={resume}")
        trainer = build_rl_actor(cfg)
        try:
            trainer.fit()
        finally:
            trainer.metrics.close()
        return {key: value.detach().clone() for key, value in trainer.chunks[0].named_parameters()}, trainer

    whole, _ = fit("whole", 2, False)
    fit("parts", 1, False)
    resumed, trainer = fit("parts", 2, True)
    assert trainer.step == 2 and trainer.order.consumed == 2 * 4
    for name, value in whole.items():
        assert torch.equal(value, resumed[name]), name


def test_distillation_across_turns_puts_no_kl_on_environment_tokens(single_process, tiny):
    """on_policy_distillation over episodes (no score: the teacher alone teaches) with the policy itself as the
    teacher: the reverse KL is 0 on every token, so every advantage is 0; and the KL of a teacher that disagrees
    everywhere, environment tokens included, lands on the model's tokens only."""
    from aligner.algorithms.rl_build import build_rl_actor

    root, policy, _ = tiny
    cfg = actor_config(tiny, "distill", f"rollout.environment={ENVIRONMENTS}:AddUp",
                       "reward.function=tests.unit.test_rl_actor:zero_reward",
                       "rollout.max_episode_tokens=48", "rollout.max_turns=3", "generation.max_new_tokens=3",
                       f"teacher.init_from={policy}", "advantage.estimator=on_policy_distillation", "kl.init_coef=1.0")
    trainer = build_rl_actor(cfg)
    try:
        batch, _ = trainer.rollouts.collect(3, {}, policy_version=0)
        plan = trainer.planner.plan_step(0, SequenceRows.of(batch))
        old = trainer.logprobs(plan)
        teacher = trainer.logprobs(plan, trainer.teacher)
        experience = trainer.make_experience(batch, old, teacher)
        assert any(row.loss_mask is not None and not row.loss_mask.all() for row in batch.rows)  # several turns
        torch.testing.assert_close(teacher, old, rtol=0, atol=1e-6)  # the same weights
        assert float(experience.advantages.abs().max()) < 1e-5 and experience.metrics["kl"] < 1e-5
        shifted = trainer.make_experience(batch, old, old - 0.5)
        assert shifted.metrics["kl"] > 0
        off_mask = ~batch.mask
        assert float(shifted.advantages[off_mask].abs().max()) == 0.0
        assert float(shifted.advantages[batch.mask].abs().min()) > 0.0
    finally:
        trainer.rollouts.close()
        trainer.metrics.close()


def test_an_episode_ended_by_a_bad_call_gets_the_fixed_advantage_and_calls_are_counted(single_process, tiny):
    """rollout.on_bad_call=fixed_advantage: the episode a tool environment ended at a bad call (marked in its info)
    trains with bad_call_advantage on each of its tokens; the others keep the group's advantages; the tool-call
    outcomes are counted per episode."""
    from aligner.algorithms.rl_build import build_rl_actor

    cfg = actor_config(tiny, "bad_call", f"rollout.environment={ENVIRONMENTS}:OneTurn", "rollout.max_episode_tokens=12",
                       "rollout.on_bad_call=fixed_advantage", "rollout.bad_call_advantage=-2.0")
    trainer = build_rl_actor(cfg)
    run = trainer.rollouts.runner.run

    def first_episode_ended_by_a_bad_call(*args, **kwargs):
        batch = run(*args, **kwargs)
        for number, episode in enumerate(batch.episodes):
            episode.info = {"tool_calls": {"ok": 1, "malformed": int(number == 0)}}
        batch.episodes[0].info["ended_by"] = "bad tool call"
        return batch

    trainer.rollouts.runner.run = first_episode_ended_by_a_bad_call
    try:
        batch, metrics = trainer.rollouts.collect(5, {}, policy_version=0)
        reference = trainer.make_experience(batch, None, None)  # as estimated: rows are the same, fixed row aside
        assert [row.fixed_advantage for row in batch.rows] == [-2.0] + [None] * 15
        assert reference.metrics["fixed_advantage_rows"] == 1.0
        torch.testing.assert_close(reference.advantages[0], -2.0 * batch.mask[0].float())
        for row in batch.rows:
            row.fixed_advantage = None
        estimated = trainer.make_experience(batch, None, None)
        torch.testing.assert_close(reference.advantages[1:], estimated.advantages[1:], rtol=0, atol=0)
        assert not torch.equal(reference.advantages[0], estimated.advantages[0])
        assert metrics["episodes/tool_calls"] == pytest.approx(17 / 16)
        assert metrics["episodes/tool_calls_ok"] == 1.0 and metrics["episodes/tool_calls_malformed"] == 1 / 16
    finally:
        trainer.rollouts.close()
        trainer.metrics.close()


def test_ppo_on_episodes_values_every_position_and_trains_the_critic_on_model_tokens(single_process, tiny):
    """algorithm=ppo with an environment: the critic is asked for the values of each whole episode, GAE's advantages
    lie on the model's tokens only, and the critic's train request carries the batch's loss mask (its model tokens),
    so the environment's tokens are not value targets."""
    from aligner.algorithms.rl_build import build_rl_actor

    from ..null_critic import NullCritic

    class Recording(NullCritic):
        def __init__(self):
            self.inferred, self.masks = [], []

        def infer_async(self, sequences):
            self.inferred.append([list(sequence) for sequence in sequences])
            return super().infer_async(sequences)

        def train_async(self, sequences, prompt_lengths, returns, old_values, loss_mask=None):
            self.masks.append(torch.as_tensor(loss_mask))
            return super().train_async(sequences, prompt_lengths, returns, old_values, loss_mask)

    critic = Recording()
    cfg = actor_config(tiny, "ppo", f"rollout.environment={ENVIRONMENTS}:AddUp", "rollout.environment_args={turns: 2}",
                       "rollout.max_episode_tokens=48", "rollout.max_turns=3",
                       "generation.max_new_tokens=3", "algorithm=ppo")
    assert cfg.uses_critic
    trainer = build_rl_actor(cfg, critic=critic)
    try:
        batch, _ = trainer.rollouts.collect(9, {}, policy_version=0)
        assert critic.inferred[-1] == [row.prompt + row.response.tolist() for row in batch.rows]
        old_logprobs = trainer.logprobs(trainer.planner.plan_step(0, SequenceRows.of(batch)))
        experience = trainer.make_experience(batch, old_logprobs, None)  # the final answers' ones reward
        assert float(experience.advantages[~batch.mask].abs().max()) == 0.0
        assert float(experience.advantages[batch.mask].abs().min()) > 0.0
        metrics = trainer.train_step()
    finally:
        trainer.rollouts.close()
        trainer.metrics.close()
    assert math.isfinite(metrics["loss"]) and metrics["episodes/turns"] == 2.0
    sent = critic.masks[-1].bool()
    assert sent.shape[0] == 16 and sent.any() and not sent.all()
    assert int(sent.sum()) == round(metrics["episodes/model_tokens"] * 16)  # the model's tokens, and only those


def test_a_raising_environment_never_leaves_the_batch_short(single_process, tiny):
    """on_failure=drop: the groups of records the environment fails on are replaced by groups of other prompts, so
    the batch is whole (16 rows, 4 groups of one prompt each) and the drops are counted; zero_reward keeps them."""
    from aligner.algorithms.rl_build import build_rl_actor
    from aligner.demo.arithmetic import parse_prompt

    for policy in ("drop", "zero_reward"):
        cfg = actor_config(tiny, f"flaky_{policy}", f"rollout.environment={ENVIRONMENTS}:Flaky",
                           "rollout.max_episode_tokens=12", f"rollout.on_failure={policy}")
        trainer = build_rl_actor(cfg)
        try:
            failing = sum(parse_prompt(trainer.prompts.prompts[i])[0] % 3 == 0 for i in trainer.order.take(4))
            trainer.order.consumed = 0  # the step takes the same four prompts again
            batch, metrics = trainer.rollouts.collect(11, {}, policy_version=0)
        finally:
            trainer.rollouts.close()
            trainer.metrics.close()
        assert failing > 0, "the seed's first prompts should include one the environment fails on"
        assert len(batch.rows) == 16 and batch.tokens.shape[0] == 16
        prompts = [tuple(row.prompt) for row in batch.rows]
        assert all(len(set(prompts[g * 4:(g + 1) * 4])) == 1 for g in range(4))  # whole groups of one prompt
        if policy == "drop":
            assert metrics["episodes/dropped"] >= 4 * failing and metrics["episodes/env_error"] == 0.0
            assert all(parse_prompt(row.given_prompt)[0] % 3 for row in batch.rows)
        else:
            assert metrics["episodes/env_error"] == failing / 4 and metrics["episodes/dropped"] == 0.0
            kept = [row for row in batch.rows if parse_prompt(row.given_prompt)[0] % 3 == 0]
            assert len(kept) == 4 * failing and all(row.score == 0.0 for row in kept)
