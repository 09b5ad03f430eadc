"""RL actor pieces that need no model: the config schemas of both yamls and their checks, the algorithm
presets, renamed keys, rollout grouping, dynamic sampling, TF-style Adam epsilon, EMA, prompt order, rollout
batches, report reduction, micro-batch seeds (the float64 tests of the math are in test_rl_math.py,
test_advantages.py, test_policy_losses.py and test_mismatch.py; end-to-end runs in tests/distributed)."""
from __future__ import annotations

import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from aligner.algorithms.rl_actor import tf_adam_epsilon, update_ema
from aligner.algorithms.rl_config import ALGORITHMS, RLActorConfig
from aligner.algorithms.rl_rollouts import group_indices
from aligner.config import CONF_DIR, ConfigError, composed_config, describe_preset, dotted_value, load_config
from aligner.generation.rewards import load_function
from aligner.generation.rollouts import (
    PromptOrder,
    RolloutBatch,
    RolloutRow,
    micro_batch_seed,
    values_at_response,
)

from ..conftest import dotted_keys

PPO_YAML = CONF_DIR / "gpt_ppo_actor.yaml"
GROUP_YAML = CONF_DIR / "gpt_reinforce_actor.yaml"
REQUIRED = ["model.init_from=x", "data.prompts=p.jsonl"]
FUNCTION_REWARD = ["reward.source=function", "reward.function=m:f"]


def _tf_adam_reference(param: float, grads: list[float], lr: float, beta1: float, beta2: float, eps: float) -> float:
    """TensorFlow's Adam in float64: lr_t = lr sqrt(1 - b2^t) / (1 - b1^t); p -= lr_t m / (sqrt(v) + eps)."""
    m = v = 0.0
    for t, g in enumerate(grads, start=1):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        lr_t = lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        param -= lr_t * m / (math.sqrt(v) + eps)
    return param


@pytest.mark.parametrize("eps", [1e-5, 1e-3])
def test_tf_adam_epsilon_makes_torch_adam_follow_tensorflow(eps):
    grads = [0.3, -1e-4, 2e-3, 0.5, -0.2, 1e-5]
    lr, beta1, beta2 = 0.1, 0.9, 0.999
    param = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    optimizer = torch.optim.Adam([param], lr=lr, betas=(beta1, beta2), eps=eps)
    plain = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    plain_optimizer = torch.optim.Adam([plain], lr=lr, betas=(beta1, beta2), eps=eps)
    for step, grad in enumerate(grads, start=1):
        optimizer.param_groups[0]["eps"] = tf_adam_epsilon(eps, beta2, step)
        for p, opt in ((param, optimizer), (plain, plain_optimizer)):
            p.grad = torch.tensor([grad], dtype=torch.float64)
            opt.step()
    expected = _tf_adam_reference(1.0, grads, lr, beta1, beta2, eps)
    assert float(param) == pytest.approx(expected, rel=1e-12, abs=1e-14)
    assert abs(float(plain) - expected) > 1e-6  # the plain epsilon really is a different optimizer here


def test_update_ema_is_the_exponential_average():
    ema = {"w": torch.tensor([0.0, 2.0])}
    history = [torch.tensor([1.0, 0.0]), torch.tensor([3.0, 1.0])]
    for value in history:
        update_ema(ema, {"w": value}, decay=0.9)
    expected = torch.tensor([0.0, 2.0], dtype=torch.float64)
    for value in history:
        expected = 0.9 * expected + 0.1 * value.double()
    torch.testing.assert_close(ema["w"].double(), expected)


def test_prompt_order_is_a_resumable_shuffle():
    order = PromptOrder(10, seed=3)
    first_epoch = order.take(4) + order.take(6)
    assert sorted(first_epoch) == list(range(10)) and first_epoch != list(range(10))
    crossing = order.take(7)  # into a differently shuffled second epoch
    resumed = PromptOrder(10, seed=3)
    resumed.load_state_dict({"consumed": 10})
    assert resumed.take(7) == crossing
    assert PromptOrder(10, seed=3, shuffle=False).take(12) == list(range(10)) + [0, 1]


def test_rollout_batch_layout_and_value_alignment():
    rows = [(5, RolloutRow(prompt=[1, 7, 8], response=torch.tensor([4, 2]), logprobs=torch.tensor([-0.5, -0.1]),
                           ended_with_stop=True, score=1.5, values=torch.tensor([0.25, 0.5]))),
            (2, RolloutRow(prompt=[1, 9], response=torch.tensor([6, 6, 6]), logprobs=torch.tensor([-1.0, -2.0, -3.0]),
                           ended_with_stop=False, score=-1.0, values=torch.tensor([1.0, 2.0, 3.0])))]
    batch = RolloutBatch.from_rows(rows, pad_id=0, seq_length=8, response_width=4)
    assert batch.indices == [5, 2]
    assert batch.tokens.tolist() == [[1, 7, 8, 4, 2, 0, 0, 0], [1, 9, 6, 6, 6, 0, 0, 0]]
    assert batch.mask.tolist() == [[True, True, False, False], [True, True, True, False]]
    assert batch.engine_logprobs[1].tolist() == [-1.0, -2.0, -3.0, 0.0]
    assert batch.scores().tolist() == [1.5, -1.0]
    assert batch.values().tolist() == [[0.25, 0.5, 0.0, 0.0], [1.0, 2.0, 3.0, 0.0]]
    assert batch.ended_with_stop.tolist() == [True, False]
    # The value of response token j is read at column prompt_length - 1 + j, like its logprob.
    column_values = torch.arange(10.0)
    assert values_at_response(column_values, 3, 2).tolist() == [2.0, 3.0]
    with pytest.raises(ValueError, match="exceeds the fixed length"):
        RolloutBatch.from_rows(rows, pad_id=0, seq_length=4)


def test_reduce_reports_sums_and_takes_extremes(single_process):
    from aligner.training.trainer import reduce_reports

    reports = [{"loss_sum": torch.tensor(1.5), "ratio_max": torch.tensor(1.2), "ratio_min": torch.tensor(0.9)},
               {"loss_sum": torch.tensor(2.0), "ratio_max": torch.tensor(1.1), "ratio_min": torch.tensor(0.7),
                "ptx_tokens": torch.tensor(4.0)}]
    assert reduce_reports(reports) == pytest.approx(
        {"loss_sum": 3.5, "ratio_max": 1.2, "ratio_min": 0.7, "ptx_tokens": 4.0})


def test_load_function_errors_say_what_is_wrong():
    assert load_function("aligner.demo.arithmetic:score_response")("2+2=", "4") == 1.0
    with pytest.raises(ValueError, match="package.module:function"):
        load_function("score_response")
    with pytest.raises(ValueError, match="cannot import"):
        load_function("no_such_module_x:f")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        load_function("aligner.demo.arithmetic:nope")


@pytest.mark.parametrize("yaml_path", [PPO_YAML, GROUP_YAML])
def test_shipped_yamls_document_every_key(yaml_path):
    from omegaconf import OmegaConf

    assert dotted_keys(OmegaConf.structured(RLActorConfig)) - dotted_keys(composed_config(yaml_path)) == set()


def test_bad_settings_are_refused_with_the_key_named():
    cfg = load_config(RLActorConfig, PPO_YAML, REQUIRED)
    cfg.validate(data_parallel_size=2)
    assert cfg.uses_critic and cfg.rollouts_per_step == 64
    bad = {
        "rollout.prompts_per_step=63": "multiple of the data-parallel size",
        "trainer.global_batch_size=48": r"divide the 64 rollouts per step \(rollout.prompts_per_step x",
        "trainer.micro_batch_size=5": "must divide the per-rank minibatch",
        "trainer.max_epochs=1": "trainer.max_steps",
        "reward.source=function": "reward.function",
        "generation.temperature=0": "temperature must be > 0",
        "loss.scale_logits_by_temperature=false": "recompute_old_logprobs",
        "loss.importance_sampling=token": "loss.recompute_old_logprobs=true",
        "reward.overlong_buffer=40": "reward.overlong_buffer=40 must lie in 1..generation.max_new_tokens",
        "ptx.data=x.jsonl": "ptx.coef",
        "advantage.estimator=grpo": "needs at least 2 samples per prompt",
        "rollout.dynamic_sampling=true": "samples_per_prompt >= 2",
    }
    for override, message in bad.items():
        extra = ["loss.recompute_old_logprobs=false"] if override.startswith(("loss.scale", "loss.importance")) else []
        with pytest.raises(ConfigError, match=message):
            load_config(RLActorConfig, PPO_YAML, [*REQUIRED, override, *extra]).validate(data_parallel_size=2)
    # Choice fields fail when the config loads, before anything is built.
    for override in ("kl.estimator=k9", "loss.aggregation=sum", "advantage.estimator=ppo", "loss.policy_loss=dpo",
                     "reward.source=critic_server", "generation.router=fast", "loss.importance_sampling=off"):
        with pytest.raises(ConfigError, match=override.split("=")[0]):
            load_config(RLActorConfig, PPO_YAML, [*REQUIRED, override])
    with pytest.raises(ConfigError, match="uses no critic"):
        load_config(RLActorConfig, GROUP_YAML, [*REQUIRED, "reward.source=combined"]).validate(data_parallel_size=1)


GROUP_ALGORITHMS = sorted(set(ALGORITHMS) - {"ppo"})  # ppo needs the critic server


@pytest.mark.parametrize("algorithm", GROUP_ALGORITHMS)
def test_every_algorithm_preset_is_a_valid_config_of_the_group_yaml(algorithm):
    cfg = load_config(RLActorConfig, GROUP_YAML, [*REQUIRED, *FUNCTION_REWARD, f"algorithm={algorithm}"])
    cfg.validate(data_parallel_size=2)
    assert not cfg.uses_critic and cfg.rollout.samples_per_prompt == 4


def test_algorithm_sets_its_preset_under_the_keys_the_user_sets(tmp_path):
    """algorithm=NAME sets every key of its preset over the config file; a key set on the command line wins,
    before or after algorithm=; a file that names the algorithm keeps its own keys over the preset."""
    base = [*REQUIRED, *FUNCTION_REWARD]
    for yaml_path in (GROUP_YAML, PPO_YAML):
        for name, preset in ALGORITHMS.items():
            cfg = load_config(RLActorConfig, yaml_path, [*base, f"algorithm={name}"])
            assert {key: dotted_value(cfg, key) for key in preset} == preset, (yaml_path.name, name)
            assert cfg.uses_critic == (name == "ppo")
    assert load_config(RLActorConfig, GROUP_YAML, base).advantage.estimator == "rloo"  # no algorithm: the file's
    for order in (["loss.clip_high=0.3", "algorithm=dapo"], ["algorithm=dapo", "loss.clip_high=0.3"]):
        cfg = load_config(RLActorConfig, GROUP_YAML, [*base, *order])
        assert cfg.loss.clip_high == 0.3 and cfg.rollout.dynamic_sampling and cfg.advantage.estimator == "grpo"
        assert describe_preset(cfg) == (
            "algorithm=dapo: advantage.estimator=grpo advantage.group_std=true loss.policy_loss=ppo_clip "
            "loss.clip_ratio=0.2 loss.aggregation=token_mean rollout.dynamic_sampling=true; kept yours: "
            "loss.clip_high=0.3")
    own = tmp_path / "gspo.yaml"
    own.write_text("algorithm: gspo\nloss:\n  clip_high: 5.0e-4\n  epochs: 2\n")
    cfg = load_config(RLActorConfig, own, [*base, "loss.clip_ratio=2e-4"])
    assert (cfg.loss.policy_loss, cfg.loss.clip_ratio, cfg.loss.clip_high, cfg.loss.epochs) == ("gspo", 2e-4, 5e-4, 2)
    assert cfg.advantage.estimator == "grpo" and cfg.loss.aggregation == "sequence_mean_token_mean"
    assert describe_preset(load_config(RLActorConfig, GROUP_YAML, base)) is None
    with pytest.raises(ConfigError, match=r"^command-line override: algorithm='grp' is not one of cispo, dapo, dr_"):
        load_config(RLActorConfig, GROUP_YAML, [*base, "algorithm=grp"])
    with pytest.raises(ConfigError, match=rf"^{own}:1: algorithm='gpso' is not one of"):
        own.write_text("algorithm: gpso\n")
        load_config(RLActorConfig, own, base)


def test_the_group_entry_point_sends_algorithm_ppo_to_the_ppo_entry_point():
    from aligner.algorithms.rl_config import GroupRLActorConfig

    # refused when the config loads, before its data files are read or anything is built
    with pytest.raises(ConfigError, match=r"^algorithm='ppo': PPO trains a critic .* use examples/nlp/gpt/train_gpt"):
        load_config(GroupRLActorConfig, GROUP_YAML, [*REQUIRED, *FUNCTION_REWARD, "algorithm=ppo"])
    assert load_config(RLActorConfig, PPO_YAML, [*REQUIRED, "algorithm=ppo"]).advantage.estimator == "gae"


def test_old_ppo_and_reinforce_keys_still_load_with_a_deprecation_line(capsys):
    cfg = load_config(RLActorConfig, PPO_YAML, [*REQUIRED, "ppo.prompts_per_step=32", "ppo.epochs=3",
                                                "ppo.reward_clip=5.0", "ppo.loss_aggregation=sequence_mean_token_sum",
                                                "reward.source=critic"])
    assert (cfg.rollout.prompts_per_step, cfg.loss.epochs, cfg.reward.clip) == (32, 3, 5.0)
    assert cfg.loss.aggregation == "sequence_mean_token_sum" and cfg.reward.source == "combined"
    cfg = load_config(RLActorConfig, GROUP_YAML, [*REQUIRED, "reinforce.samples_per_prompt=8",
                                                  "reinforce.baseline=grpo"])
    assert cfg.rollout.samples_per_prompt == 8 and cfg.advantage.estimator == "grpo"
    err = capsys.readouterr().err
    assert err.count("deprecated:") == 7 and "ppo.epochs; it is now loss.epochs" in err


def test_each_prompt_is_repeated_k_times_adjacent():
    assert group_indices([7, 2], 3) == [7, 7, 7, 2, 2, 2]
    assert group_indices([7, 2], 1) == [7, 2]


def test_micro_batch_seeds_differ_per_micro_batch_and_are_valid_engine_seeds():
    seeds = {micro_batch_seed(seed, first) for seed in (0, 1, 2**32 - 1) for first in range(0, 4096, 16)}
    assert len(seeds) == 3 * 256 and all(0 <= s < 2**32 for s in seeds)
    assert micro_batch_seed(5, 32) == micro_batch_seed(5, 32)  # deterministic: any replica draws the same

# ----------------------------------------------------------------------------- dynamic sampling
def _dynamic_sampling_collector(prompts_per_step: int, k: int, max_rounds: int, score):
    """A RolloutCollector whose generation is replaced by `score(prompt index, sample) -> float` (no model)."""
    import torch.distributed as dist

    from aligner.algorithms.rl_rollouts import RolloutCollector
    from aligner.training.microbatch_plan import DataParallel

    cfg = load_config(RLActorConfig, GROUP_YAML, [
        *REQUIRED, *FUNCTION_REWARD, f"rollout.prompts_per_step={prompts_per_step}",
        f"rollout.samples_per_prompt={k}", "rollout.dynamic_sampling=true",
        f"rollout.max_sampling_rounds={max_rounds}"])
    collector = RolloutCollector(cfg, chunks=[], engine=None, router=None, reward_source=None, critic=None,
                                 prompts=None, order=PromptOrder(1000, seed=0, shuffle=False), tokenizer=None,
                                 data_parallel=DataParallel(dist.group.WORLD, 0, 1),
                                 model_parallel_group=dist.group.WORLD)
    collector.rounds = []

    def generate_and_score(indices, timings, *, seed, with_values):
        collector.rounds.append((list(indices), seed))
        rows = {position: SimpleNamespace(prompt_index=index, score=score(index, position % k))
                for position, index in enumerate(indices)}
        return rows, float(len(indices))

    collector.generate_and_score = generate_and_score
    collector.to_batch = lambda mine: mine
    return collector


def test_dynamic_sampling_keeps_informative_groups_until_the_batch_is_full(single_process):
    # Prompts divisible by 3 get the same score for all samples: those groups teach nothing.
    collector = _dynamic_sampling_collector(4, 2, 5, lambda index, sample: 1.0 if index % 3 == 0 else float(sample))
    mine, metrics = collector.collect(1234, {})
    prompts = [row.prompt_index for _, row in mine]
    assert prompts == [1, 1, 2, 2, 4, 4, 5, 5]  # prompts 0 and 3 dropped; round 2 (prompts 4..7) filled the batch
    assert [position for position, _ in mine] == list(range(8))  # positions are the new batch's, groups adjacent
    assert len(collector.rounds) == 2 and collector.rounds[0][0] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert collector.rounds[0][1] == 1234 and collector.rounds[1][1] != collector.rounds[0][1]  # seed, then others
    assert metrics["dynamic_sampling_rounds"] == 2 and metrics["dynamic_sampling_filled_groups"] == 0
    assert metrics["dynamic_sampling_kept_fraction"] == pytest.approx(5 / 8)  # 1, 2 | 4, 5, 7 of 8 groups
    assert collector.order.consumed == 8


def test_dynamic_sampling_stops_at_its_cap_and_fills_with_uniform_groups(single_process):
    # Only prompt 1 ever gets different scores: the cap ends sampling with the batch still short.
    collector = _dynamic_sampling_collector(4, 2, 3, lambda index, sample: float(sample) if index == 1 else 0.5)
    mine, metrics = collector.collect(1234, {})
    assert len(collector.rounds) == 3 and collector.order.consumed == 12
    assert metrics["dynamic_sampling_rounds"] == 3 and metrics["dynamic_sampling_filled_groups"] == 3
    prompts = [row.prompt_index for _, row in mine]
    assert prompts[:2] == [1, 1] and prompts[2:] == [9, 9, 10, 10, 11, 11]  # the newest uniform groups fill it
    assert metrics["dynamic_sampling_kept_fraction"] == pytest.approx(1 / 12)


# ----------------------------------------------------------------------------- a step's experience
def _hand_made_batch(generator: torch.Generator) -> RolloutBatch:
    """Two groups of two rollouts (lengths 3, 1, 4, 2; scores 0, 1, 2, 0) with random engine logprobs."""
    rows = [(i, RolloutRow(prompt=[1, 5], response=torch.randint(3, 9, (n,), generator=generator),
                           logprobs=-torch.rand(n, generator=generator), ended_with_stop=True, score=float(i % 3)))
            for i, n in enumerate([3, 1, 4, 2])]
    return RolloutBatch.from_rows(rows, pad_id=0, response_width=4)


def _experience_actor(cfg):
    """An RLActor built on stand-ins for what make_experience does not read (a one-layer model, no engine,
    router, servers or prompts; one process, no critic)."""
    from aligner.algorithms.rl_actor import RLActor
    from aligner.algorithms.rl_objective import PolicyObjective

    objective = PolicyObjective(8, 1.0, cfg.loss, cfg.clip_high, cfg.constant_normalizer, 0.0)
    return RLActor(cfg, policy=SimpleNamespace(chunks=[torch.nn.Linear(1, 1)], objective=objective), reference=None,
                   engine=None, router=None, reward_source=None, critic=None, prompts=[], validation_prompts=None,
                   ptx_loader=None, tokenizer=SimpleNamespace(pad_id=0), model_cfg=None, metrics=None)


@pytest.mark.parametrize("level", ["none", "token", "sequence"])
def test_experience_carries_the_mismatch_and_the_importance_weights_of_the_engine(single_process, level):
    """make_experience on a hand-made batch: the GRPO advantages, the mismatch metrics and the truncated
    importance weights are the pure functions' (checked against float64 in test_mismatch.py) of the
    engine's and the trainer's logprobs."""
    from aligner.rl import advantages, mismatch, shaping

    cfg = load_config(RLActorConfig, GROUP_YAML, [
        *REQUIRED, *FUNCTION_REWARD, "rollout.samples_per_prompt=2", "advantage.estimator=grpo",
        f"loss.importance_sampling={level}", "loss.importance_sampling_cap=1.5"])
    generator = torch.Generator().manual_seed(3)
    batch = _hand_made_batch(generator)
    # The trainer's logprobs: the engine's, perturbed (a bf16 or TRT-LLM engine would differ like this).
    trainer_logprobs = batch.engine_logprobs + 0.4 * torch.randn(batch.mask.shape, generator=generator)
    reference_logprobs = trainer_logprobs - 0.1

    actor = _experience_actor(cfg)
    experience = actor.make_experience(batch, trainer_logprobs, reference_logprobs)

    kl = shaping.kl_penalty(trainer_logprobs, reference_logprobs, cfg.kl.estimator, batch.mask)
    expected = advantages.compute_advantages("grpo", advantages.AdvantageInputs(
        scores=batch.scores(), kl=kl, kl_coef=cfg.kl.init_coef, mask=batch.mask, group_size=2),
        actor.advantage_settings)
    torch.testing.assert_close(experience.advantages, expected.advantages)
    reported = mismatch.mismatch_metrics(trainer_logprobs, batch.engine_logprobs, batch.mask)
    assert reported["mismatch_kl"] > 1e-3  # the perturbation shows
    assert {key: experience.metrics[key] for key in reported} == pytest.approx(reported)
    if level == "none":
        assert experience.importance_weights is None
    else:
        weights = mismatch.truncated_importance_weights(trainer_logprobs, batch.engine_logprobs, batch.mask, level, 1.5)
        torch.testing.assert_close(experience.importance_weights, weights)
        assert float(experience.importance_weights.max()) == pytest.approx(1.5)  # the cap binds somewhere


# ----------------------------------------------------------------------------- every preset, one real step
@pytest.fixture(scope="module")
def tiny_policy_and_prompts(tmp_path_factory, arithmetic_tokenizer_dir):
    """A random-init 2-layer policy on the demo's character tokenizer, and 32 demo prompts."""
    from ..tiny_actor import two_layer_policy_and_prompts

    return two_layer_policy_and_prompts(tmp_path_factory.mktemp("rl_presets"), arithmetic_tokenizer_dir, 32)


def _tiny_actor_config(tiny_policy_and_prompts, name: str, *settings: str) -> RLActorConfig:
    """The group yaml on the tiny policy: 8 prompts x 4 samples, two minibatches of 16, the ones reward."""
    root, policy, prompts = tiny_policy_and_prompts
    return load_config(RLActorConfig, GROUP_YAML, [
        f"model.init_from={policy}", f"data.prompts={prompts}", "data.max_prompt_length=8",
        "generation.max_new_tokens=4", "generation.micro_batch_size=16", "rollout.prompts_per_step=8",
        "trainer.global_batch_size=16", "trainer.micro_batch_size=8", "reward.source=function",
        "reward.function=tests.faults.errors_sft:ones_reward", "logging.progress_bar=false",
        "logging.tensorboard=false", "logging.peak_tflops=1.0", f"checkpoint.save_dir={root / name / 'ckpt'}",
        f"logging.log_dir={root / name}", "checkpoint.resume=false", *settings])


@pytest.mark.parametrize("algorithm, extra", [
    *[(name, ()) for name in GROUP_ALGORITHMS],
    ("grpo", ("loss.importance_sampling=token",)),
    ("grpo", ("loss.importance_sampling=sequence", "reward.overlong_buffer=2")),
])
def test_every_preset_runs_a_step_of_the_real_actor(single_process, tiny_policy_and_prompts, algorithm, extra):
    """One step of each algorithm through build_rl_actor (native engine, megatron schedule, two minibatches):
    the first minibatch has ratio 1, the engine matches the trainer, the loss is finite."""
    from aligner.algorithms.rl_build import build_rl_actor

    cfg = _tiny_actor_config(tiny_policy_and_prompts, f"{algorithm}_{len(extra)}", "optim.lr=1e-2",
                             "kl.init_coef=0.05", "logging.samples_interval=1", f"algorithm={algorithm}", *extra)
    trainer = build_rl_actor(cfg)
    try:
        metrics = trainer.train_step()
    finally:
        trainer.rollouts.router.close()
        trainer.metrics.close()
    assert trainer.rollouts.engine.packed_weight_bytes == 0  # the stale packed copies are not kept through training
    for key in ("first_ratio_mean", "first_ratio_max", "first_ratio_min"):
        assert metrics[key] == pytest.approx(1.0, abs=1e-6), key
    assert math.isfinite(metrics["loss"]) and metrics["mismatch_kl"] < 1e-5
    assert metrics["ratio_max"] - metrics["ratio_min"] > 1e-4  # the second minibatch ran on updated weights
    assert "kl" in metrics and metrics["share_reference"] > 0  # kl.init_coef > 0: the reference pass runs
    # The timed parts of the step are disjoint intervals inside it (nothing overlaps without a critic):
    # each part this step runs took time, each share is its time over the step's, and what is left
    # (untimed bookkeeping) is a remainder in [0, 1). Timings, not speeds: load cannot break this.
    for part in ("generation", "logprobs", "reference", "train"):
        assert metrics[f"time_{part}"] > 0, part
    shares = {key: value for key, value in metrics.items() if key.startswith("share_")}
    for key, share in shares.items():
        assert share == pytest.approx(metrics["time_" + key.removeprefix("share_")] / metrics["step_time"]), key
        assert 0 <= share <= 1, key
    assert -1e-9 <= 1 - sum(shares.values()) < 1
    if cfg.rollout.dynamic_sampling:
        assert 1 <= metrics["dynamic_sampling_rounds"] <= cfg.rollout.max_sampling_rounds
        assert metrics["uniform_group_fraction"] == pytest.approx(metrics["dynamic_sampling_filled_groups"] / 8)


def test_a_fixed_kl_coefficient_of_zero_skips_the_reference_pass(single_process, tiny_policy_and_prompts):
    """Its penalty is 0 whatever the reference says: the actor keeps no host copy of the reference
    weights, the step runs no reference forward and logs no KL."""
    from aligner.algorithms.rl_build import build_rl_actor

    cfg = _tiny_actor_config(tiny_policy_and_prompts, "kl0", "kl.init_coef=0.0")
    assert not cfg.measures_kl
    trainer = build_rl_actor(cfg)
    try:
        assert trainer.reference is None
        metrics = trainer.train_step()
    finally:
        trainer.rollouts.router.close()
        trainer.metrics.close()
    assert "kl" not in metrics and "time_reference" not in metrics
    assert metrics["first_ratio_max"] == pytest.approx(1.0, abs=1e-6)


def response_length_reward(prompt, response_text: str) -> float:
    """A reward that differs between a group's samples (their lengths differ): nonzero advantages."""
    return float(len(response_text))


def test_a_single_update_takes_the_rollout_logprobs_from_its_own_forward(single_process, tiny_policy_and_prompts):
    """One epoch of one minibatch at a fixed KL of 0: no separate logprob pass. The update's forward runs
    on the rollout weights, so the step moves the weights as with the recomputed logprobs (up to float
    rounding), and the engine/trainer mismatch is measured on that forward instead."""
    from aligner.algorithms.rl_build import build_rl_actor

    results = {}
    for own_forward in (True, False):
        cfg = _tiny_actor_config(tiny_policy_and_prompts, f"own_forward_{own_forward}", "optim.lr=1e-3",
                                 "kl.init_coef=0.0", "trainer.global_batch_size=32", "trainer.micro_batch_size=8",
                                 "reward.function=tests.unit.test_rl_actor:response_length_reward",
                                 f"loss.old_logprobs_from_update={str(own_forward).lower()}")
        assert cfg.old_logprobs_in_update is own_forward
        trainer = build_rl_actor(cfg)
        try:
            before = [p.detach().clone() for p in trainer.chunks[0].parameters()]
            metrics = trainer.train_step()
            after = [p.detach().clone() for p in trainer.chunks[0].parameters()]
        finally:
            trainer.rollouts.router.close()
            trainer.metrics.close()
        results[own_forward] = metrics, before, after
    (own, before, after), (recomputed, _, after_recomputed) = results[True], results[False]
    assert "time_logprobs" not in own and recomputed["time_logprobs"] > 0
    assert own["grad_norm"] > 1e-3 and any(not torch.equal(a, b) for a, b in zip(before, after))
    assert own["grad_norm"] == pytest.approx(recomputed["grad_norm"], rel=1e-5)
    assert own["loss"] == pytest.approx(recomputed["loss"], rel=1e-5, abs=1e-7)
    for moved, reference in zip(after, after_recomputed):
        torch.testing.assert_close(moved, reference, rtol=0, atol=1e-6)
    assert own["first_ratio_max"] == own["first_ratio_min"] == 1.0
    for key in ("mismatch_kl", "mismatch_ratio_mean", "mismatch_ratio_max", "mismatch_ratio_min",
                "mismatch_abs_logprob_diff_max"):
        assert own[key] == pytest.approx(recomputed[key], abs=1e-6), key
    assert own["mismatch_abs_logprob_diff_max"] < 1e-4  # the engine samples in fp32 from the same weights


@pytest.mark.parametrize("setting", ["loss.epochs=2", "trainer.global_batch_size=16", "kl.init_coef=0.05",
                                     "loss.importance_sampling=token", "loss.recompute_old_logprobs=false",
                                     "loss.disable_dropout=false", "loss.old_logprobs_from_update=false"])
def test_the_rollout_logprobs_come_from_a_separate_pass_unless_the_step_is_one_update(setting):
    """Several updates, a KL penalty or importance weights read the rollout policy's logprobs before (or
    after) the weights move: then they are recomputed in a pass of their own (or, if asked, the engine's)."""
    single = [*REQUIRED, *FUNCTION_REWARD, "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
              "trainer.global_batch_size=32", "trainer.micro_batch_size=8", "kl.init_coef=0.0"]
    assert load_config(RLActorConfig, GROUP_YAML, single).old_logprobs_in_update
    assert not load_config(RLActorConfig, GROUP_YAML, [*single, setting]).old_logprobs_in_update


@pytest.mark.parametrize("estimator", ["rloo", "grpo", "reinforce_plus_plus"])
def test_without_the_reference_pass_the_advantages_are_the_same_at_kl_coefficient_zero(single_process, estimator):
    cfg = load_config(RLActorConfig, GROUP_YAML, [*REQUIRED, *FUNCTION_REWARD, "rollout.samples_per_prompt=2",
                                                  f"advantage.estimator={estimator}", "kl.init_coef=0.0"])
    batch = _hand_made_batch(torch.Generator().manual_seed(5))
    actor = _experience_actor(cfg)
    skipped = actor.make_experience(batch, batch.engine_logprobs, None)
    measured = actor.make_experience(batch, batch.engine_logprobs, batch.engine_logprobs - torch.rand(4, 4) - 0.5)
    assert torch.equal(skipped.advantages, measured.advantages)
    assert torch.equal(skipped.sequence_rewards, measured.sequence_rewards)
    assert "kl" not in skipped.metrics and measured.metrics["kl"] > 0


def test_a_run_talks_preset_steps_samples_summary_and_its_router_port(single_process, tiny_policy_and_prompts,
                                                                      monkeypatch):
    """What the console shows of an RL run: the preset line, a short line for the first and the last step
    although log_interval is longer than the run, sample completions (first and last step), the summary; the
    router listens on generation.router_port; the same run again has nothing to train."""
    import socket

    from aligner.algorithms.rl_build import build_rl_actor
    from aligner.training.metrics import MetricsLogger, read_metrics

    from ..conftest import free_port_block

    shown: list[str] = []
    monkeypatch.setattr(MetricsLogger, "write", lambda self, message: shown.append(message))
    port = free_port_block(1)
    settings = ("algorithm=grpo", "kl.init_coef=0.05", "trainer.max_steps=2", "logging.log_interval=100",
                "logging.samples_interval=5", "logging.num_samples=2", "logging.sample_chars=24",
                f"generation.router_port={port}")
    cfg = _tiny_actor_config(tiny_policy_and_prompts, "talks", *settings)
    trainer = build_rl_actor(cfg)
    try:
        assert trainer.rollouts.router._server.address[1] == port
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        assert trainer.nothing_to_train() is None
        trainer.fit()
        summary = trainer.metrics.run_summary(seconds=12.5, checkpoint=Path("ckpt/step_00000002"),
                                              next_commands=["python chat.py"])
    finally:
        trainer.rollouts.router.close()
        trainer.metrics.close()
    assert describe_preset(cfg) in shown and describe_preset(cfg).startswith("algorithm=grpo: advantage.estimator=grpo")
    steps = [line for line in shown if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == ["step 1/2", "step 2/2"]
    rows = read_metrics(cfg.logging.log_dir, "train")
    for line, row in zip(steps, rows):
        assert 80 <= len(line) <= 200, line
        fields = dict(part.split("=") for part in line.split(": ", 1)[1].split(" ") if "=" in part)
        for label, key in (("loss", "loss"), ("reward", "reward_mean"), ("kl", "kl"), ("lr", "lr")):
            # 4 decimals, or 4 significant digits below 1e-3
            assert float(fields[label]) == pytest.approx(row[key], rel=1e-3, abs=5e-5), label
        assert "tokens/s=" in line and fields["time"] == f"{row['step_time']:.2f}s"
        assert len(row) > 40  # the full set still goes to metrics.jsonl
    samples = [line for line in shown if line.startswith("sample ")]
    assert [line.split(":")[0] for line in samples] == ["sample 1/2 at step 1", "sample 2/2 at step 1",
                                                        "sample 1/2 at step 2", "sample 2/2 at step 2"]
    for sample in samples:
        head, prompt, response = sample.split("\n")
        assert head.split(": ")[1].startswith("reward=")
        assert prompt.startswith("  prompt:   '") and response.startswith("  response: ")
        assert len(prompt.split(": ", 1)[1].strip()) <= 24 and len(response.split(": ", 1)[1].strip()) <= 24
    assert summary[0].startswith(f"done: 2 step(s) in 12.5 s, now at step 2/2, final loss {rows[-1]['loss']:.4f}")
    generated = sum(row["generated_tokens"] for row in rows)
    assert f"{generated:,.0f} tokens generated" in summary[0]
    assert summary[1:] == ["checkpoint: ckpt/step_00000002", "next: python chat.py"]

    again = build_rl_actor(_tiny_actor_config(tiny_policy_and_prompts, "talks", *settings, "checkpoint.resume=true"))
    try:
        assert again.nothing_to_train() == ("already at step 2 of trainer.max_steps=2", "trainer.max_steps")
    finally:
        again.rollouts.router.close()
        again.metrics.close()


def test_a_router_port_in_use_is_one_line_naming_the_key(single_process):
    import socket

    from aligner.generation.router_client import DynamicRouter

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^the rollout router cannot listen on 127.0.0.1:{port} .*: choose "
                                              r"another generation.router_port \(0: a free port\)$"):
            DynamicRouter(micro_batch_size=4, host="127.0.0.1", port=port)


def test_bf16_on_a_cpu_trains_through_an_fp32_main_copy_with_a_first_ratio_of_one(single_process,
                                                                                  tiny_policy_and_prompts):
    """precision=bf16 on a CPU: bf16 weights shared by engine and trainer, fp32 main copies in the optimizer."""
    from aligner.algorithms.rl_build import build_rl_actor

    cfg = _tiny_actor_config(tiny_policy_and_prompts, "bf16", "optim.lr=1e-2", "kl.init_coef=0.05",
                             "precision=bf16", "algorithm=grpo")
    trainer = build_rl_actor(cfg)
    try:
        before = [p.detach().clone() for p in trainer.chunks[0].parameters()]
        metrics = trainer.train_step()
    finally:
        trainer.rollouts.router.close()
        trainer.metrics.close()
    params = list(trainer.chunks[0].parameters())
    assert all(p.dtype == torch.bfloat16 for p in params)
    for param in params:
        assert param.main_param.dtype == torch.float32
        assert torch.equal(param, param.main_param.to(torch.bfloat16))  # the step went through the fp32 copy
    assert any(not torch.equal(param, old) for param, old in zip(params, before))
    for key in ("first_ratio_mean", "first_ratio_max", "first_ratio_min"):
        assert metrics[key] == 1.0, key  # same precision, same trainer forward: exactly 1
    # The engine computes in bf16 with other kernels than the trainer: close, not equal.
    assert 0 < metrics["mismatch_abs_logprob_diff_max"] < 0.05 and metrics["mismatch_kl"] < 1e-4


def test_bf16_cpu_support_is_read_from_the_cpu_flags(tmp_path):
    from aligner.runtime import cpu_bridge

    with_bf16, without = tmp_path / "with", tmp_path / "without"
    with_bf16.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 avx512_vnni\n")
    without.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n")
    assert cpu_bridge.cpu_has_bf16_instructions(str(with_bf16))
    assert not cpu_bridge.cpu_has_bf16_instructions(str(without))
    assert not cpu_bridge.cpu_has_bf16_instructions(str(tmp_path / "missing"))


def test_grpo_with_lora_samples_from_the_current_adapters_against_the_base_as_reference(single_process,
                                                                                       tiny_policy_and_prompts):
    """peft.scheme=lora in the RL actor: only adapters move; the reference is the base with the adapters
    off (no host copy of the weights); the engine generates with the adapters as trained so far, so the
    engine/trainer mismatch stays at rounding after the adapters moved away from the base (a stale engine
    would show the whole policy/base difference there); the checkpoint holds the adapters and resumes."""
    from aligner import checkpointing
    from aligner.algorithms.rl_build import build_rl_actor
    from aligner.models import lora

    settings = ("optim.lr=5e-2", "kl.init_coef=0.05", "peft.scheme=lora", "peft.rank=4", "peft.dropout=0.1",
                "reward.function=tests.unit.test_rl_actor:response_length_reward", "algorithm=grpo")
    cfg = _tiny_actor_config(tiny_policy_and_prompts, "lora", *settings)
    trainer = build_rl_actor(cfg)
    try:
        assert isinstance(trainer.reference, lora.BaseReference)
        assert all(m.lora_dropout == 0.0 for m in lora.adapter_modules(trainer.chunks))  # loss.disable_dropout
        frozen = {n: p.detach().clone() for n, p in trainer.chunks[0].named_parameters() if not lora.is_adapter_key(n)}
        steps = []
        for _ in range(3):  # as fit() steps
            steps.append(trainer.train_step())
            trainer.step += 1
        path = trainer.save()
        adapters = {n: p.detach().clone() for n, p in trainer.chunks[0].named_parameters() if lora.is_adapter_key(n)}
    finally:
        trainer.rollouts.router.close()
        trainer.metrics.close()
    for name, param in trainer.chunks[0].named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]), name
    assert any((m.lora_b != 0).any() for m in lora.adapter_modules(trainer.chunks))
    for metrics in steps:
        assert metrics["first_ratio_max"] == pytest.approx(1.0, abs=1e-6)
        assert metrics["mismatch_abs_logprob_diff_max"] < 1e-4
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-9)  # B = 0: policy = base at the first rollouts
    assert steps[-1]["kl"] > 1e3 * steps[-1]["mismatch_kl"]  # the adapters moved; the engine moved with them
    assert checkpointing.read_meta(path)["peft"]["rank"] == 4

    resumed = build_rl_actor(_tiny_actor_config(tiny_policy_and_prompts, "lora", *settings,
                                                "checkpoint.resume=true"))
    try:
        assert resumed.step == 3
        for name, param in resumed.chunks[0].named_parameters():
            assert torch.equal(param, adapters[name] if name in adapters else frozen[name]), name
    finally:
        resumed.rollouts.router.close()
        resumed.metrics.close()


def zero_reward(prompt, response_text: str) -> float:
    """No task reward: on-policy distillation learns from the teacher alone."""
    return 0.0


def _teacher(root, tokenizer_dir, hidden: int, seed: int):
    """A random-init 2-layer model `hidden` wide, saved with `tokenizer_dir`."""
    from aligner import checkpointing
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
    from aligner.runtime import distributed, seeds
    from aligner.tokenizer import Tokenizer

    distributed.initialize(distributed.ParallelConfig())
    try:
        seeds.set_seed(seed)
        cfg = GPTConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=2 * hidden, vocab_size=Tokenizer(tokenizer_dir).vocab_size,
                        max_position_embeddings=64)
        return checkpointing.save(root, [build_gpt_model(cfg, transformer_config(cfg))], model_config=cfg.to_dict(),
                                  tokenizer_dir=tokenizer_dir)
    finally:
        distributed.shutdown()


def test_on_policy_distillation_moves_the_policy_towards_a_teacher_of_another_size(tmp_path):
    """teacher.init_from + advantage.estimator=on_policy_distillation: the teacher (a 2 x 32 model SFT-trained
    on the demo task) is the reference of a random-init 2 x 48 policy, each token's advantage minus its
    log-ratio to the teacher; the reverse KL to the teacher falls. A teacher with another tokenizer, or the
    estimator without a teacher, is refused."""
    from aligner.algorithms.rl_build import build_rl_actor
    from aligner.demo.tokenizer import train_char_tokenizer
    from aligner.runtime import distributed

    from ..conftest import train_tiny_arithmetic_policy

    teacher, prompts = train_tiny_arithmetic_policy(tmp_path, seed=4, steps=60)
    student = _teacher(tmp_path / "student", tmp_path / "tokenizer", hidden=48, seed=21)
    setup = (tmp_path, student, prompts)
    settings = (f"teacher.init_from={teacher}", "advantage.estimator=on_policy_distillation", "kl.init_coef=1.0",
                "reward.function=tests.unit.test_rl_actor:zero_reward", "optim.lr=5e-3")
    trainer = build_rl_actor(_tiny_actor_config(setup, "opd", *settings))
    try:
        assert trainer.teacher is not None and trainer.reference is None
        steps = []
        for _ in range(12):
            steps.append(trainer.train_step())
            trainer.step += 1
    finally:
        trainer.rollouts.router.close()
        trainer.metrics.close()
        distributed.shutdown()
    kls = [metrics["kl"] for metrics in steps]
    print("reverse KL to the teacher per step", [round(kl, 3) for kl in kls])
    assert kls[0] > 1.0 and sum(kls[-3:]) / 3 < 0.5 * kls[0], kls
    assert steps[0]["first_ratio_max"] == pytest.approx(1.0, abs=1e-6)

    train_char_tokenizer(["abcdefghij klmnop"], tmp_path / "other_tokenizer")
    other = _teacher(tmp_path / "other_teacher", tmp_path / "other_tokenizer", hidden=32, seed=3)
    with pytest.raises(ConfigError, match="its tokenizer .* is not the policy's"):
        build_rl_actor(_tiny_actor_config(setup, "opd_other", *settings[1:], f"teacher.init_from={other}"))
    distributed.shutdown()
    with pytest.raises(ConfigError, match="on_policy_distillation learns from the reverse KL to a teacher"):
        build_rl_actor(_tiny_actor_config(setup, "opd_none", *settings[1:]))
    distributed.shutdown()
    with pytest.raises(ConfigError, match="teacher.init_from is read through the KL term"):
        build_rl_actor(_tiny_actor_config(setup, "opd_kl0", settings[0], "kl.init_coef=0.0"))
    distributed.shutdown()


def test_the_critic_is_saved_before_the_actor_and_put_back_to_the_actor_s_step_on_resume(single_process,
                                                                                       tiny_policy_and_prompts):
    """PPO's checkpoints pair up: the critic's checkpoint of a step is asked for before the actor's exists (a server
    lost between the two leaves the critic ahead, never behind), and a resumed actor puts the critic server back to
    its checkpoint of the resumed step, whatever the server trained since."""
    from aligner import checkpointing
    from aligner.algorithms.rl_build import build_rl_actor

    from ..null_critic import NullCritic

    class Recording(NullCritic):
        def __init__(self, save_dir: Path):
            self.save_dir, self.calls = save_dir, []

        def save(self, step: int) -> str:
            self.calls.append(("save", step, checkpointing.step_dir(self.save_dir, step).exists()))
            return f"critic/step_{step}"

        def restore(self, step: int) -> str:
            self.calls.append(("restore", step))
            return f"critic/step_{step}"

    root = tiny_policy_and_prompts[0]
    settings = ("algorithm=ppo", "trainer.max_steps=2", "checkpoint.save_interval=1")
    critic = Recording(root / "paired" / "ckpt")
    trainer = build_rl_actor(_tiny_actor_config(tiny_policy_and_prompts, "paired", *settings), critic=critic)
    try:
        trainer.fit()
    finally:
        trainer.metrics.close()
    assert critic.calls == [("save", 1, False), ("save", 2, False)]  # each before the actor's step_N existed
    assert checkpointing.step_dir(critic.save_dir, 2).is_dir()

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    resumed, lines = Recording(critic.save_dir), Lines()
    logging.getLogger("aligner").addHandler(lines)  # (its own handler may hold an earlier test's stdout)
    try:
        trainer = build_rl_actor(_tiny_actor_config(tiny_policy_and_prompts, "paired", *settings,
                                                    "checkpoint.resume=true", "trainer.max_steps=3"), critic=resumed)
    finally:
        logging.getLogger("aligner").removeHandler(lines)
    try:
        assert resumed.calls == [("restore", 2)]  # while the run was built, before any rollout
        trainer.fit()
    finally:
        trainer.metrics.close()
    assert resumed.calls == [("restore", 2), ("save", 3, False)]
    assert "restored the critic server to its checkpoint of step 2 (critic/step_2)" in lines.messages
