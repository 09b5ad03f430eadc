"""REINFORCE/RLOO actor pieces that need no model: the config schema and its checks, rollout grouping,
per-micro-batch sampling seeds (the end-to-end runs are in tests/distributed/test_reinforce.py)."""
from __future__ import annotations

import pytest

from aligner.algorithms.reinforce import ReinforceConfig, ReinforceTrainer
from aligner.config import CONF_DIR, load_config
from aligner.rl.rollouts import micro_batch_seed

from ..conftest import dotted_keys

YAML = CONF_DIR / "gpt_reinforce_actor.yaml"
REQUIRED = ["model.init_from=x", "data.prompts=p.jsonl", "reward.source=function", "reward.function=m:f"]


def test_shipped_yaml_documents_every_key_and_bad_settings_are_refused():
    from omegaconf import OmegaConf

    assert dotted_keys(OmegaConf.structured(ReinforceConfig)) - dotted_keys(OmegaConf.load(YAML)) == set()
    cfg = load_config(ReinforceConfig, YAML, REQUIRED)
    cfg.validate(data_parallel_size=2)
    assert cfg.rollouts_per_step == 256 and cfg.ppo is cfg.reinforce  # the PPO update code reads cfg.ppo
    bad = {
        "reinforce.prompts_per_step=63": "multiple of the data-parallel size",
        "trainer.global_batch_size=96": r"divide the 256 rollouts per step",
        "trainer.micro_batch_size=5": "must divide the per-rank minibatch",
        "reinforce.baseline=loo": "reinforce.baseline",
        "reinforce.samples_per_prompt=1": "at least 2 samples",
        "kl.estimator=k9": "kl.estimator",
        "reinforce.loss_aggregation=sum": "loss_aggregation",
        "reward.source=critic": "must be one of server, function",
        "generation.temperature=0": "temperature must be > 0",
        "trainer.max_epochs=1": "trainer.max_steps",
    }
    for override, message in bad.items():
        with pytest.raises(ValueError, match=message):
            load_config(ReinforceConfig, YAML, [*REQUIRED, override]).validate(data_parallel_size=2)
    # Plain REINFORCE (no baseline, no std) works with one sample per prompt.
    load_config(ReinforceConfig, YAML, [*REQUIRED, "reinforce.samples_per_prompt=1", "reinforce.baseline=none",
                                        "trainer.global_batch_size=64"]).validate(data_parallel_size=2)


def test_each_prompt_is_repeated_k_times_adjacent():
    trainer = ReinforceTrainer.__new__(ReinforceTrainer)  # group_indices only reads the config
    trainer.cfg = load_config(ReinforceConfig, YAML, [*REQUIRED, "reinforce.samples_per_prompt=3"])
    assert trainer.group_indices([7, 2]) == [7, 7, 7, 2, 2, 2]


def test_micro_batch_seeds_differ_per_micro_batch_and_are_valid_engine_seeds():
    seeds = {micro_batch_seed(seed, first) for seed in (0, 1, 2**32 - 1) for first in range(0, 4096, 16)}
    assert len(seeds) == 3 * 256 and all(0 <= s < 2**32 for s in seeds)
    assert micro_batch_seed(5, 32) == micro_batch_seed(5, 32)  # deterministic: any replica draws the same
