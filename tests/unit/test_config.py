"""Config loading: schema-checked yaml, key=value overrides, unknown keys are errors."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from aligner.algorithms.dpo import DPOConfig
from aligner.algorithms.reward_model import RewardModelConfig
from aligner.algorithms.rl_actor import RLActorConfig
from aligner.algorithms.sft import SFTConfig
from aligner.algorithms.spin import SPINConfig
from aligner.config import CONF_DIR, ConfigError, load_config, parse_command_line
from servers.critic import CriticServerConfig

from ..conftest import dotted_keys

SFT_YAML = CONF_DIR / "gpt_sft.yaml"


def test_shipped_yaml_loads_and_overrides_apply():
    cfg = load_config(SFTConfig, SFT_YAML, ["trainer.max_steps=7", "optim.lr=0.5", "data.train=[{path: a.jsonl, weight: 2}]"])
    assert cfg.trainer.max_steps == 7
    assert cfg.optim.lr == 0.5
    assert cfg.data.train[0].path == "a.jsonl" and cfg.data.train[0].weight == 2.0
    assert cfg.model.architecture.normalization == "RMSNorm"


@pytest.mark.parametrize("schema, yaml_name, required", [
    (SFTConfig, "gpt_sft.yaml", ("data.train=[{path: x.jsonl}]",)),
    (RewardModelConfig, "training_rm.yaml", ("data.train=[{path: x.jsonl}]",)),
    (CriticServerConfig, "gpt_ppo_critic.yaml", ("critic.init_from=/checkpoint",)),
    (RLActorConfig, "gpt_ppo_actor.yaml", ("data.prompts=p.jsonl", "model.init_from=/checkpoint")),
    (RLActorConfig, "gpt_reinforce_actor.yaml", ("data.prompts=p.jsonl", "model.init_from=/checkpoint")),
    (DPOConfig, "gpt_dpo.yaml", ("data.train=[{path: x.jsonl}]", "model.init_from=/checkpoint")),
    (SPINConfig, "gpt_spin.yaml", ("data.train=[{path: x.jsonl}]", "model.init_from=/checkpoint")),
])
def test_every_schema_key_is_in_the_shipped_yaml(schema, yaml_name, required):
    """The yaml documents every key the entry point reads, and loads against its schema."""
    from omegaconf import OmegaConf

    schema_keys = dotted_keys(OmegaConf.structured(schema))
    in_yaml = dotted_keys(OmegaConf.load(CONF_DIR / yaml_name))
    assert schema_keys - in_yaml == set(), f"keys missing from conf/{yaml_name}"
    load_config(schema, CONF_DIR / yaml_name, list(required))  # unknown yaml keys would raise


def test_unknown_keys_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="trainer.max_stepz"):
        load_config(SFTConfig, SFT_YAML, ["trainer.max_stepz=3"])
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text(SFT_YAML.read_text().replace("max_steps: 100", "max_steps: 100\n  warmup: 3"))
    with pytest.raises(ConfigError, match=r"bad.yaml.*trainer.warmup"):
        load_config(SFTConfig, bad_yaml, [])


def test_type_errors_and_malformed_overrides():
    with pytest.raises(ConfigError, match="trainer.max_steps"):
        load_config(SFTConfig, SFT_YAML, ["trainer.max_steps=many"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(SFTConfig, SFT_YAML, ["trainer.max_steps"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(SFTConfig, CONF_DIR / "nope.yaml", [])


def test_command_line_parsing():
    path, overrides = parse_command_line("default.yaml", ["--config", "x.yaml", "a=1", "b.c=2"])
    assert str(path) == "x.yaml" and overrides == ["a=1", "b.c=2"]
    path, overrides = parse_command_line("default.yaml", ["--config=y.yaml"])
    assert str(path) == "y.yaml" and overrides == []


# ----------------------------------------------------------------------------- renamed keys
@dataclass
class _Rollout:
    prompts_per_step: int = 4
    samples_per_prompt: int = 1

@dataclass
class _RenamedSchema:
    RENAMED_KEYS: ClassVar[tuple] = (("ppo.prompts_per_step", "rollout.prompts_per_step"), ("rm_model_file", "init_from"))
    rollout: _Rollout = field(default_factory=_Rollout)
    init_from: str = "x"

def test_renamed_keys_load_under_their_new_names_with_a_deprecation_line(tmp_path, capsys):
    y = tmp_path / "a.yaml"
    y.write_text("ppo:\n  prompts_per_step: 7\nrm_model_file: r\n")
    cfg = load_config(_RenamedSchema, y, ["ppo.prompts_per_step=9"])
    assert cfg.rollout.prompts_per_step == 9 and cfg.init_from == "r"
    err = capsys.readouterr().err
    assert err.count("deprecated") == 3, err
    y.write_text("rollout:\n  prompts_per_step: 7\nppo:\n  prompts_per_step: 3\n")
    with pytest.raises(ConfigError, match="old name of rollout.prompts_per_step"):
        load_config(_RenamedSchema, y)
