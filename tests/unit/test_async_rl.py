"""Asynchronous RL (rollout.asynchronous): a generation worker process overlapping training.

max_staleness 0 is the synchronous run bit for bit; staleness is bounded by admission and the run does not depend
on the worker's timing; the decoupled correction's gradient is the on-policy gradient in expectation (Monte Carlo on
a softmax policy, float64); a resumed run continues exactly; a worker that dies or stalls, or a weight copy that
stalls, ends the run within its timeout with one line (or the worker is started again); the settings it cannot run
are refused in one line; multi-turn episodes run in the worker, each as old as its oldest token and weighted per
token; a worker server (another host's worker, over TCP) gives the local worker's run, and its loss or a wrong key
ends the run with one line.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from aligner.algorithms.rl_config import RLActorConfig
from aligner.config import CONF_DIR, ConfigError, load_config
from aligner.generation.worker import FAULT_ONCE_VARIABLE, FAULT_VARIABLE, KEY_VARIABLE, GenerationWorkerError
from aligner.rl import mismatch, policy_losses
from aligner.runtime.errors import UserError

GROUP_YAML = CONF_DIR / "gpt_reinforce_actor.yaml"
ENVIRONMENTS = Path(__file__).resolve().parents[1] / "agent_envs.py"
UNTIMED = ("time_", "share_", "step_time", "rollout_tokens_per_second", "tokens_per_second", "mfu", "async/")
CORRECTED = ("loss.importance_sampling=token", "loss.importance_sampling_cap=2.0")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, arithmetic_tokenizer_dir):
    """A random-init 2-layer policy on the demo's character tokenizer and 32 demo prompts."""
    from ..tiny_actor import two_layer_policy_and_prompts

    return two_layer_policy_and_prompts(tmp_path_factory.mktemp("async_rl"), arithmetic_tokenizer_dir, 32)


def actor_overrides(tiny, log_dir: Path, save_dir: Path) -> list[str]:
    """GRPO on the tiny policy with a reward for the share of "1"s: 4 prompts x 4 samples, two minibatches."""
    _, policy, prompts = tiny
    return [f"model.init_from={policy}", f"data.prompts={prompts}", "data.max_prompt_length=8",
            "generation.max_new_tokens=6", "generation.micro_batch_size=8", "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=4", "trainer.global_batch_size=8", "trainer.micro_batch_size=8",
            "reward.source=function", "reward.function=tests.faults.errors_sft:ones_reward", "algorithm=grpo",
            "optim.lr=3e-2", "kl.init_coef=0.05", "logging.progress_bar=false", "logging.tensorboard=false",
            "logging.peak_tflops=1.0", f"checkpoint.save_dir={save_dir}", f"logging.log_dir={log_dir}",
            "checkpoint.resume=false", "checkpoint.save_interval=0", "rollout.asynchronous.worker_threads=1"]


def actor_config(tiny, name: str, *settings: str) -> RLActorConfig:
    root = tiny[0]
    return load_config(RLActorConfig, GROUP_YAML,
                       [*actor_overrides(tiny, root / name, root / name / "ckpt"), *settings])


def fit(cfg: RLActorConfig, critic=None):
    """Train cfg's steps (with `critic`, a critic client's stand-in); (the weights, each step's metrics, the actor)."""
    from aligner.algorithms.rl_build import build_rl_actor
    from aligner.training.metrics import read_metrics

    trainer = build_rl_actor(cfg, critic=critic)
    try:
        trainer.fit()
    finally:
        trainer.metrics.close()
    weights = {key: value.detach().clone() for key, value in trainer.chunks[0].named_parameters()}
    rows = [row for row in read_metrics(cfg.logging.log_dir, "train", newest_attempt=True)]
    return weights, rows, trainer


def untimed(row: dict) -> dict:
    return {key: value for key, value in row.items() if not key.startswith(UNTIMED)}


def assert_same_weights(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    for name, value in first.items():
        assert torch.equal(value, second[name]), name


def test_max_staleness_0_is_the_synchronous_run_bit_for_bit(single_process, tiny):
    sync_weights, sync_rows, _ = fit(actor_config(tiny, "sync", "trainer.max_steps=3"))
    async_weights, async_rows, trainer = fit(actor_config(tiny, "async0", "trainer.max_steps=3",
                                                          "rollout.asynchronous.enabled=true",
                                                          "rollout.asynchronous.max_staleness=0"))
    assert trainer.asynchronous is not None and trainer.asynchronous.worker is None  # closed at the end
    assert_same_weights(sync_weights, async_weights)
    assert [untimed(row) for row in async_rows] == [untimed(row) for row in sync_rows]
    assert [row["async/staleness_max"] for row in async_rows] == [0.0, 0.0, 0.0]
    assert sync_rows[-1]["reward_mean"] != sync_rows[0]["reward_mean"]  # the steps did something


def test_staleness_is_bounded_by_admission_and_the_run_does_not_depend_on_timing(single_process, tiny, monkeypatch):
    """max_staleness 2 with the worker sleeping a random 0-0.4 s before each command, against the same run with no
    delays: the same weights and metrics (which version generates a step is fixed by admission, not timing); every
    consumed rollout exactly min(step, 2) versions old; every prompt consumed once, in order; none dropped."""
    settings = ("trainer.max_steps=5", "rollout.asynchronous.enabled=true", "rollout.asynchronous.max_staleness=2",
                *CORRECTED)
    steady_weights, steady_rows, _ = fit(actor_config(tiny, "steady", *settings))
    monkeypatch.setenv(FAULT_VARIABLE, "delay:0.4:7")
    delayed_weights, delayed_rows, trainer = fit(actor_config(tiny, "delayed", *settings))
    assert_same_weights(steady_weights, delayed_weights)
    assert [untimed(row) for row in delayed_rows] == [untimed(row) for row in steady_rows]
    for step, row in enumerate(delayed_rows):
        assert row["async/staleness_max"] == row["async/staleness_mean"] == min(step, 2)
        assert row["generated_tokens"] == pytest.approx(row["response_length"] * 16)  # every rollout was trained on
    assert trainer.order.consumed == 5 * 4
    assert all(0.0 < row["importance_weight_mean"] < 2.0 for row in delayed_rows)
    sync_weights, _, _ = fit(actor_config(tiny, "sync_for_stale", "trainer.max_steps=5", *CORRECTED))
    assert any(not torch.equal(value, sync_weights[name]) for name, value in delayed_weights.items())


def test_ppo_with_a_critic_and_its_warm_up_round_runs_asynchronously(single_process, tiny):
    """PPO (GAE on a critic's values, which depend on the tokens; one warm-up round of the critic first, generated
    in the trainer): max_staleness 0 is the synchronous run bit for bit; at max_staleness 1 the steps after the
    first train on one-version-old rollouts, valued by the critic when they are consumed."""
    from ..null_critic import TokenCritic

    ppo = ("algorithm=ppo", "critic.warmup_steps=1", "trainer.max_steps=3")
    sync_weights, sync_rows, _ = fit(actor_config(tiny, "ppo_sync", *ppo), TokenCritic())
    async_weights, async_rows, _ = fit(actor_config(tiny, "ppo_async0", *ppo, "rollout.asynchronous.enabled=true",
                                                    "rollout.asynchronous.max_staleness=0"), TokenCritic())
    assert_same_weights(sync_weights, async_weights)
    assert [untimed(row) for row in async_rows] == [untimed(row) for row in sync_rows]
    assert len(sync_rows) == 3 and all(row["values_mean"] != 0 for row in sync_rows)  # GAE on the values
    stale_weights, stale_rows, trainer = fit(actor_config(
        tiny, "ppo_async1", *ppo, "rollout.asynchronous.enabled=true", "rollout.asynchronous.max_staleness=1",
        *CORRECTED), TokenCritic())
    assert [row["async/staleness_max"] for row in stale_rows] == [0.0, 1.0, 1.0]
    assert trainer.order.consumed == 4 * 4  # the warm-up round's prompts and three steps', each once
    assert any(not torch.equal(value, sync_weights[name]) for name, value in stale_weights.items())


def test_a_run_stopped_by_sigterm_resumes_exactly_where_the_uninterrupted_one_went(single_process, tiny, handlers):
    """max_staleness 1: 4 steps in one go; and the same run sent SIGTERM during step 2, which saves at step 2 (with
    step 3's rollouts, made by the weights of step 1), and a new actor resumed from that checkpoint: the same
    weights, and step 3 as old as in the uninterrupted run."""
    from aligner.algorithms.rl_build import build_rl_actor
    from aligner.runtime import stopping

    settings = ("trainer.max_steps=4", "rollout.asynchronous.enabled=true", "rollout.asynchronous.max_staleness=1",
                *CORRECTED)
    whole, whole_rows, _ = fit(actor_config(tiny, "whole", *settings))

    trainer = build_rl_actor(actor_config(tiny, "parts", *settings))
    original = trainer.train_step

    def signalled_step(*args, **kwargs):
        if trainer.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler ran (and only recorded the signal)
        return original(*args, **kwargs)

    trainer.train_step = signalled_step
    try:
        with pytest.raises(stopping.Stopped):
            trainer.fit()
    finally:
        trainer.metrics.close()
    assert trainer.step == 2 and trainer.asynchronous.worker is None  # stopped at the boundary; no worker left
    stopping.reset()
    resumed, rows, trainer = fit(actor_config(tiny, "parts", *settings, "checkpoint.resume=true"))
    assert trainer.step == 4
    assert [row["async/staleness_max"] for row in rows[-2:]] == [row["async/staleness_max"]
                                                                 for row in whole_rows[-2:]] == [1.0, 1.0]
    assert_same_weights(whole, resumed)


def test_a_worker_that_dies_ends_the_run_with_one_line_or_is_started_again(single_process, tiny, monkeypatch,
                                                                            tmp_path):
    settings = ("trainer.max_steps=3", "rollout.asynchronous.enabled=true", "rollout.asynchronous.max_staleness=0")
    monkeypatch.setenv(FAULT_VARIABLE, "die_at_step:1")
    with pytest.raises(GenerationWorkerError) as failure:
        fit(actor_config(tiny, "dies", "rollout.asynchronous.restarts=0", *settings))
    line = str(failure.value)
    assert "\n" not in line and "exited with code 3 while generating step 2" in line
    assert "rollout.asynchronous.restarts=0" in line
    # Once (the marker file): the restarted worker generates step 2 again, from the same weights (staleness 0).
    monkeypatch.setenv(FAULT_ONCE_VARIABLE, str(tmp_path / "fired"))
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("aligner")  # the run's log lines (aligner.training.metrics.get_logger)
    logger.addHandler(handler)
    try:
        restarted, rows, _ = fit(actor_config(tiny, "restarted", *settings))
    finally:
        logger.removeHandler(handler)
    output = "\n".join(lines)
    assert (tmp_path / "fired").exists() and len(rows) == 3
    assert "exited with code 3 while generating step 2; starting it again (1 of 1 restarts), steps 2..2 " \
           "generated again with the weights of version 1" in output, output[-2000:]
    monkeypatch.delenv(FAULT_VARIABLE)
    steady, _, _ = fit(actor_config(tiny, "not_restarted", *settings))
    assert_same_weights(steady, restarted)


# Episodes of two turns: the environment asks two sums, the reward function scores the final answer's share of 1s.
EPISODES = (f"rollout.environment={ENVIRONMENTS}:AddUp", "rollout.environment_args={turns: 2}",
            "rollout.max_episode_tokens=40", "rollout.max_turns=3", "generation.max_new_tokens=3")


@pytest.mark.slow
def test_multi_turn_episodes_run_asynchronously_and_resume_from_the_queue(single_process, tiny):
    """The generation worker runs whole episodes (its own sandbox pool and environment instances; the trainer scores
    them): max_staleness 0 is the synchronous episode run bit for bit; at max_staleness 1 each step after the first
    trains on episodes of the previous version, every token of an episode from one version; a checkpoint at step 2
    keeps step 3's episodes (made by version 1), and a run resumed from it trains on the uninterrupted run's
    episodes to its weights."""
    sync_weights, sync_rows, _ = fit(actor_config(tiny, "episodes_sync", "trainer.max_steps=3", *EPISODES))
    async_weights, async_rows, _ = fit(actor_config(tiny, "episodes_async0", "trainer.max_steps=3", *EPISODES,
                                                    "rollout.asynchronous.enabled=true",
                                                    "rollout.asynchronous.max_staleness=0"))
    assert_same_weights(sync_weights, async_weights)
    # The engine's logprobs alone may differ in their last bits: the native engine decodes the episodes' turns
    # together as their environments answer, so a row's batch companions depend on timing (two synchronous runs
    # differ the same way); they enter only the engine/trainer mismatch metrics here, not the loss.
    for row, reference in zip(async_rows, sync_rows):
        assert ({k: v for k, v in untimed(row).items() if not k.startswith("mismatch_")}
                == {k: v for k, v in untimed(reference).items() if not k.startswith("mismatch_")})
        engine_side = [key for key in reference if key.startswith("mismatch_")]
        assert engine_side and all(row[key] == pytest.approx(reference[key], abs=1e-6) for key in engine_side)
    assert all(row["episodes/turns"] == 2.0 and row["episodes/environment_tokens"] > 0 for row in sync_rows)
    assert sync_rows[-1]["reward_mean"] != sync_rows[0]["reward_mean"]

    stale = ("trainer.max_steps=4", *EPISODES, "rollout.asynchronous.enabled=true",
             "rollout.asynchronous.max_staleness=1", *CORRECTED)
    whole, whole_rows, trainer = fit(actor_config(tiny, "episodes_async1", *stale, "checkpoint.save_interval=2"))
    assert [row["async/staleness_max"] for row in whole_rows] == [0.0, 1.0, 1.0, 1.0]
    assert [row["async/staleness_mean"] for row in whole_rows] == [0.0, 1.0, 1.0, 1.0]
    assert trainer.order.consumed == 4 * 4
    assert any(not torch.equal(value, sync_weights[name]) for name, value in whole.items())
    save_dir = Path(trainer.cfg.checkpoint.save_dir)
    saved = json.loads((save_dir / "step_00000002" / "aligner_meta.json").read_text())["trainer_state"]["asynchronous"]
    (queued,) = saved["ready_by_replica"]
    assert [(step, version) for step, version, _, _ in queued] == [(2, 1)]  # step 3's episodes, made by version 1
    episodes = queued[0][3]["batch"]["episodes"]
    assert len(episodes) == 16 and all(segment[3] in (None, 1) for e in episodes for segment in e["segments"])
    shutil.rmtree(save_dir / "step_00000004")
    resumed, rows, trainer = fit(actor_config(tiny, "episodes_async1", *stale, "checkpoint.save_interval=2",
                                              "checkpoint.resume=true"))
    assert trainer.step == 4 and [row["async/staleness_max"] for row in rows[-2:]] == [1.0, 1.0]
    # The same episodes (rewards, lengths); the weights within float32 rounding: at max_staleness 1 the engine's
    # logprobs enter the loss (the importance weights), and their last bits depend on the turns' batching (above).
    assert ([(row["reward_mean"], row["response_length"]) for row in rows[-2:]]
            == [(row["reward_mean"], row["response_length"]) for row in whole_rows[-2:]])
    for name, value in whole.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-6, msg=name)


def test_an_episode_of_several_versions_is_weighted_per_token_and_as_old_as_its_oldest_token():
    """An episode whose model turns came from versions 3 and 5 (as a rollout continued on newer weights would be;
    the worker makes each episode with one version today, so this is built by hand): its row keeps
    each token's own behaviour logprob, the truncated importance weight of every model token is min(pi_prox /
    pi_behav, cap) with that token's own logprob (float64 reference), environment tokens get none, and the row's
    staleness counts from version 3."""
    from aligner.agents.episode import Episode, Segment
    from aligner.agents.rollout import episode_row
    from aligner.generation.rollouts import RolloutBatch

    episode = Episode([Segment.prompt([1, 2, 3])])
    episode.add_model([4, 5], [-0.5, -1.25], policy_version=3)
    episode.add([Segment.environment([6, 7, 8])])
    episode.add_model([9, 10, 11], [-2.0, -0.125, -3.0], policy_version=5)
    episode.end("done")
    assert Episode.from_plain(json.loads(json.dumps(episode.to_plain()))) == episode
    row = episode_row(episode)
    row.policy_version = episode.oldest_version
    assert row.policy_version == 3
    batch = RolloutBatch.from_rows([(0, row)], pad_id=0)
    proximal = torch.tensor([[-0.25, -1.5, 0.0, 0.0, 0.0, -2.5, -0.5, -1.0]])
    cap = 2.0
    weights = mismatch.truncated_importance_weights(proximal, batch.engine_logprobs, batch.mask, "token", cap)
    behaviour = [-0.5, -1.25, None, None, None, -2.0, -0.125, -3.0]
    expected = [0.0 if b is None else min(math.exp(float(p) - b), cap) for p, b in zip(proximal[0].tolist(), behaviour)]
    assert batch.mask[0].tolist() == [b is not None for b in behaviour]
    assert weights[0].double().tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("fault, timeout, doing", [
    ("stall_at_step:1", "rollout.asynchronous.silence_timeout_s=3", "said nothing for 3 s while generating step 2"),
    ("stall_weights_at:1", "rollout.asynchronous.weight_timeout_s=2",
     "said nothing for 2 s while loading the weights of version 1"),
])
def test_a_stalled_worker_or_weight_copy_ends_the_run_within_its_timeout(single_process, tiny, monkeypatch, fault,
                                                                         timeout, doing):
    monkeypatch.setenv(FAULT_VARIABLE, fault)
    cfg = actor_config(tiny, "stalls", "trainer.max_steps=3", "rollout.asynchronous.enabled=true",
                       "rollout.asynchronous.max_staleness=0", "rollout.asynchronous.restarts=0", timeout)
    start = time.monotonic()
    with pytest.raises(GenerationWorkerError, match=doing):
        fit(cfg)
    assert time.monotonic() - start < 120  # two steps, the worker's start and the timeout, not the 600 s default


@pytest.mark.parametrize("settings, message", [
    (("rollout.asynchronous.max_staleness=1",), "loss.importance_sampling=token"),
    (("rollout.asynchronous.max_staleness=0", "rollout.dynamic_sampling=true"), "rollout.dynamic_sampling=false"),
    (("rollout.asynchronous.max_staleness=0", "generation.engine=trtllm"), "generation.engine=native"),
])
def test_settings_it_cannot_run_are_refused_in_one_line(tiny, settings, message):
    cfg = actor_config(tiny, "refused", "rollout.asynchronous.enabled=true", *settings)
    with pytest.raises(ConfigError, match=message) as refusal:
        cfg.validate(1)
    assert "\n" not in str(refusal.value)
    data_parallel = actor_config(tiny, "refused", "rollout.asynchronous.enabled=true", "trainer.micro_batch_size=4",
                                 *CORRECTED)
    data_parallel.validate(2)  # a worker per rank (tests/distributed/test_async_rl_parallel.py)
    with pytest.raises(ConfigError, match="TP=PP=1"):
        actor_config(tiny, "refused", "rollout.asynchronous.enabled=true", "parallel.tensor_model_parallel_size=2",
                     *CORRECTED).validate(1)


def test_a_checkpoint_of_another_data_parallel_size_is_refused_in_one_line():
    """The outstanding rollouts are each rank's worker's: a resume at another data-parallel size cannot use them."""
    from types import SimpleNamespace

    from aligner.algorithms.rl_async import AsyncRollouts

    row = [[1, 0, list(range(4)), [[0, [1, 2], [3], [-0.5], True]]]]  # step 1, version 0, its prompts, one row
    for state, size in (({"ready_by_replica": [row, row]}, 1), ({"ready": row}, 2), ({"ready_by_replica": [row]}, 2)):
        rollouts = SimpleNamespace(data_parallel=SimpleNamespace(size=size, rank=0), episodes=False)
        with pytest.raises(ConfigError, match="at the data-parallel size that saved it") as refusal:
            AsyncRollouts.load_state_dict(rollouts, state)
        assert "\n" not in str(refusal.value)
    rollouts = SimpleNamespace(data_parallel=SimpleNamespace(size=2, rank=1), episodes=False)
    AsyncRollouts.load_state_dict(rollouts, {"ready_by_replica": [[], row]})
    assert list(rollouts.ready) == [1] and rollouts.ready[1][2] == {0: ([1, 2], [3], [-0.5], True)}
    # nothing outstanding: nothing lost
    rollouts = SimpleNamespace(data_parallel=SimpleNamespace(size=1, rank=0), episodes=False)
    AsyncRollouts.load_state_dict(rollouts, {"ready_by_replica": [[], []]})
    assert rollouts.ready == {}


# ----------------------------------------------------------------------------- the correction, in float64
def _expected_gradient(logits: torch.Tensor, weights_of, probabilities: torch.Tensor, advantages: torch.Tensor,
                       proximal: torch.Tensor) -> torch.Tensor:
    """d/d logits of sum_a probabilities(a) * weights_of(a) * loss(a): the exact expectation of the per-token
    ppo_clip loss's gradient when a is drawn from `probabilities`."""
    logits = logits.clone().requires_grad_(True)
    actions = torch.arange(len(advantages))
    logprobs = torch.log_softmax(logits, -1)[actions].reshape(1, -1)
    mask = torch.ones_like(logprobs, dtype=torch.bool)
    terms = policy_losses.policy_loss_terms("ppo_clip", logprobs, proximal.reshape(1, -1), advantages.reshape(1, -1),
                                            mask, clip_low=0.2, clip_high=0.2, weights=weights_of.reshape(1, -1))
    (terms.per_token.reshape(-1) * probabilities).sum().backward()
    return logits.grad


def test_the_decoupled_correction_gives_the_on_policy_gradient_in_expectation():
    """A softmax policy over 6 tokens; behaviour (the stale sampler) != proximal (the trainer's policy at the step's
    start) != current (mid-update, some ratios past the clip). The on-policy PPO gradient is the expectation over
    the proximal policy of the clipped loss's gradient. Sampling from the behaviour policy, the loss weighted by
    min(prox / behav, cap) (mismatch.truncated_importance_weights, the cap above every ratio) estimates it: the
    Monte Carlo mean over 400,000 draws lies within 5 standard errors of the exact value on every logit, and
    without the weights it does not (more than 20 standard errors off)."""
    generator = torch.Generator().manual_seed(0)
    vocab = 6
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.3, 0.8], dtype=torch.float64)
    proximal_logits = torch.randn(vocab, generator=generator, dtype=torch.float64)
    behaviour_logits = proximal_logits + 0.8 * torch.randn(vocab, generator=generator, dtype=torch.float64)
    current_logits = proximal_logits + 0.4 * torch.randn(vocab, generator=generator, dtype=torch.float64)
    proximal = torch.log_softmax(proximal_logits, -1)
    behaviour = torch.log_softmax(behaviour_logits, -1)
    assert (torch.exp(torch.log_softmax(current_logits, -1) - proximal) - 1).abs().max() > 0.2  # the clip is active
    cap = float(torch.exp(proximal - behaviour).max()) * 1.01

    exact = _expected_gradient(current_logits, torch.ones(vocab, dtype=torch.float64), proximal.exp(), advantages,
                               proximal)

    draws = 400_000
    actions = torch.multinomial(behaviour.exp(), draws, replacement=True, generator=generator)
    mask = torch.ones(1, draws, dtype=torch.bool)
    weights = mismatch.truncated_importance_weights(proximal[actions].reshape(1, -1), behaviour[actions].reshape(1, -1),
                                                    mask, "token", cap).double()

    def per_draw_gradients(draw_weights: torch.Tensor) -> torch.Tensor:
        """[draws, vocab]: each draw's loss gradient (the loss is linear in one-hot counts, so per action once)."""
        by_action = torch.stack([
            _expected_gradient(current_logits, torch.ones(vocab, dtype=torch.float64),
                               torch.nn.functional.one_hot(torch.tensor(a), vocab).double(), advantages, proximal)
            for a in range(vocab)])
        return by_action[actions] * draw_weights.reshape(-1, 1)

    for draw_weights, should_match in ((weights, True), (torch.ones(1, draws, dtype=torch.float64), False)):
        gradients = per_draw_gradients(draw_weights)
        mean, standard_error = gradients.mean(0), gradients.std(0) / math.sqrt(draws)
        z = ((mean - exact).abs() / standard_error).max()
        if should_match:
            assert z < 5, (mean, exact, z)
        else:
            assert z > 20, (mean, exact, z)


# -- a generation worker server (examples/nlp/gpt/serve_generation_worker.py): the same worker over TCP
SERVER = Path(__file__).resolve().parents[2] / "examples" / "nlp" / "gpt" / "serve_generation_worker.py"


@contextlib.contextmanager
def worker_server(key: str, *, fault: str = ""):
    """A worker server on 127.0.0.1 (a free port), one thread; yields (its address, its output so far)."""
    env = {**os.environ, KEY_VARIABLE: key, FAULT_VARIABLE: fault}
    server = subprocess.Popen([sys.executable, str(SERVER), "--host", "127.0.0.1", "--port", "0", "--threads", "1"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        first = server.stdout.readline()
        lines.append(first)
        match = re.search(r"ready on (\S+:\d+)", first)
        assert match, first + server.stdout.read() if server.poll() is not None else first
        threading.Thread(target=lambda: lines.extend(server.stdout), daemon=True).start()
        yield match.group(1), server, lines
    finally:
        server.terminate()
        server.wait(10)


@pytest.mark.slow
def test_a_worker_server_gives_the_local_worker_s_run_and_serves_trainer_after_trainer(single_process, tiny,
                                                                                       monkeypatch):
    """max_staleness 1 with the worker on a server (weights over TCP, one thread as the local worker): the local
    worker's run bit for bit, twice from the same server (the second trainer connects after the first left); two
    servers splitting each step's micro-batches: the same samples, and losses to float32 rounding."""
    settings = ("trainer.max_steps=3", "rollout.asynchronous.enabled=true", "rollout.asynchronous.max_staleness=1",
                *CORRECTED)
    local_weights, local_rows, _ = fit(actor_config(tiny, "local_worker", *settings))
    monkeypatch.setenv(KEY_VARIABLE, "test-key")
    with worker_server("test-key") as (address, server, output):
        for attempt in ("remote_1", "remote_2"):
            remote_weights, remote_rows, trainer = fit(actor_config(tiny, attempt, *settings,
                                                                    f"rollout.asynchronous.workers=[{address}]"))
            assert_same_weights(local_weights, remote_weights)
            assert [untimed(row) for row in remote_rows] == [untimed(row) for row in local_rows]
            assert trainer.asynchronous.worker is None
        assert server.poll() is None  # still serving
        with worker_server("test-key") as (second, _, second_output):  # two servers split the rank's micro-batches
            pooled_weights, pooled_rows, _ = fit(actor_config(tiny, "remote_pool", *settings,
                                                              f"rollout.asynchronous.workers=[{address}, {second}]"))
            # the same samples; the engine's logprobs (the behaviour policy's, in the correction) depend on which
            # rows share a decode batch, to float32 rounding
            for one, two in zip(local_rows, pooled_rows, strict=True):
                assert two["reward_mean"] == one["reward_mean"] and two["response_length"] == one["response_length"]
                assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-6)
                assert two["importance_weight_mean"] == pytest.approx(one["importance_weight_mean"], rel=1e-5)
    assert sum("serving a trainer" in line for line in output) == 3, output
    assert any("replica 2 of 2" in line for line in second_output), second_output


def test_a_lost_worker_server_or_a_wrong_key_ends_the_run_with_one_line(single_process, tiny, monkeypatch):
    silence_s = 300
    settings = ("trainer.max_steps=3", "rollout.asynchronous.enabled=true", "rollout.asynchronous.max_staleness=0",
                f"rollout.asynchronous.silence_timeout_s={silence_s}")
    monkeypatch.setenv(KEY_VARIABLE, "test-key")
    with worker_server("test-key", fault="die_at_step:1") as (address, server, _):
        start = time.monotonic()
        with pytest.raises(GenerationWorkerError) as failure:  # the restart finds no server
            fit(actor_config(tiny, "server_lost", *settings, f"rollout.asynchronous.workers=[{address}]"))
        line = str(failure.value)
        assert "\n" not in line and line.startswith(f"cannot reach the generation worker at {address}"), line
        # the lost connection is seen at once, not after the silence timeout: the bound is far under it, and far
        # over the run's few seconds alone (37 s at a load of 20 broke an earlier bound of 25 s)
        assert time.monotonic() - start < silence_s / 2 and server.wait(10) == 3
    with worker_server("another-key") as (address, _, _):
        with pytest.raises(GenerationWorkerError, match="the keys differ: set the same ALIGNER_WORKER_KEY"):
            fit(actor_config(tiny, "wrong_key", *settings, f"rollout.asynchronous.workers=[{address}]"))


@pytest.mark.parametrize("workers, key, ranks, episodes, message", [
    ("[127.0.0.1:5570, 127.0.0.1:5571, 127.0.0.1:5572]", "k", 2, False,
     "names 3 worker server\\(s\\) for 2 data-parallel rank\\(s\\): give each rank as many"),
    ("[127.0.0.1:5570, 127.0.0.1:5571]", "k", 1, True, "multi-turn episodes run on one worker per data-parallel"),
    ("[127.0.0.1]", "k", 1, False, "rollout.asynchronous.workers: '127.0.0.1' is not HOST:PORT"),
    ("[127.0.0.1:5570]", "", 1, False, "ALIGNER_WORKER_KEY is not set"),
])
def test_worker_server_settings_are_checked_before_the_run(tiny, monkeypatch, workers, key, ranks, episodes,
                                                           message):
    monkeypatch.setenv(KEY_VARIABLE, key)
    cfg = actor_config(tiny, "refused", "rollout.asynchronous.enabled=true", "rollout.asynchronous.max_staleness=0",
                       "trainer.micro_batch_size=4", f"rollout.asynchronous.workers={workers}",
                       *(EPISODES if episodes else ()))
    with pytest.raises(UserError, match=message) as refusal:
        cfg.validate(ranks)
    assert "\n" not in str(refusal.value)
