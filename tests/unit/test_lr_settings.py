"""Learning-rate settings for real models: optim.min_lr null (0.1 x lr), the warm-up and lr-range warnings,
the recipes (aligner/conf/recipes/, a yaml that `extends` an entry point's) and the table they must agree with."""
from __future__ import annotations

import math
import re

import pytest

from aligner.algorithms.dpo import DPOConfig
from aligner.algorithms.rl_config import RLActorConfig
from aligner.algorithms.sft import SFTConfig
from aligner.config import CONF_DIR, ConfigError, load_config
from aligner.training.lr_ranges import known_rate, lr_warning
from aligner.training.metrics import get_logger
from aligner.training.setup import OptimConfig, build_scheduler

from .test_schedule_resume import ParamGroups

SFT_REQUIRED = ["data.train=[{path: x.jsonl}]"]
SMOLLM2_PARAMETERS = 134.5e6
RECIPES = {  # recipe -> (schema, what it needs besides)
    "smollm2_sft_full.yaml": (SFTConfig, SFT_REQUIRED),
    "smollm2_sft_lora.yaml": (SFTConfig, SFT_REQUIRED),
    "smollm2_dpo_full.yaml": (DPOConfig, SFT_REQUIRED),
    "smollm2_dpo_lora.yaml": (DPOConfig, SFT_REQUIRED),
    "smollm2_grpo_full.yaml": (RLActorConfig, ["model.init_from=x", "data.prompts=p.jsonl", "reward.function=m:f"]),
    "smollm2_grpo_lora.yaml": (RLActorConfig, ["model.init_from=x", "data.prompts=p.jsonl", "reward.function=m:f"]),
}


def _lrs(optim: OptimConfig, total: int) -> list[float]:
    """The lr each of `total` optimizer steps trains at (the trainer reads it before the scheduler steps)."""
    optimizer = ParamGroups(optim)
    scheduler = build_scheduler(optimizer, optim, total)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    return lrs


def test_setting_lr_alone_decays_to_a_tenth_of_it():
    cfg = load_config(SFTConfig, CONF_DIR / "gpt_sft.yaml", [*SFT_REQUIRED, "optim.lr=5e-6", "optim.warmup_steps=0"])
    assert cfg.optim.min_lr is None and cfg.optim.final_lr == pytest.approx(5e-7)
    lrs = _lrs(cfg.optim, 11)
    # cosine from lr to 0.1 lr over 11 steps, in float64: lr_k = min + (lr - min) (1 + cos(pi k / 11)) / 2
    expected = [5e-7 + 4.5e-6 * (1 + math.cos(math.pi * step / 11)) / 2 for step in range(11)]
    assert lrs == pytest.approx(expected, rel=1e-12)
    explicit = load_config(SFTConfig, CONF_DIR / "gpt_sft.yaml", [*SFT_REQUIRED, "optim.lr=5e-6", "optim.min_lr=0"])
    assert explicit.optim.final_lr == 0.0
    with pytest.raises(ConfigError, match=r"^optim.min_lr=1e-05: the cosine decay ends at min_lr, which must not "
                                          r"exceed lr=5e-06 \(null: 0.1 x lr\)$"):
        load_config(SFTConfig, CONF_DIR / "gpt_sft.yaml", [*SFT_REQUIRED, "optim.lr=5e-6", "optim.min_lr=1e-5"])


def test_a_warm_up_not_shorter_than_the_run_is_one_warning_line(caplog):
    # the log records, not capsys: the aligner logger's console handler may hold the stdout of an earlier test
    get_logger().addHandler(caplog.handler)  # the aligner logger does not propagate to caplog's root handler
    caplog.clear()

    def logged() -> str:
        text = "\n".join(record.getMessage() for record in caplog.records)
        caplog.clear()
        return text

    optim = OptimConfig(lr=1e-5, warmup_steps=10)
    assert _lrs(optim, 3) == pytest.approx([0.0, 5e-6, 1e-5])
    lines = [line for line in logged().splitlines() if "warning" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "warning: optim.warmup_steps=10 is not shorter than the run's 3 optimizer steps: the warm-up is cut to 2, "
        "so the first step trains at lr 0 and only the last at optim.lr=1e-05; set optim.warmup_steps below 3 "
        "(0: no warm-up)"), lines
    _lrs(OptimConfig(lr=1e-5, warmup_steps=2), 3)
    assert "warning" not in logged()
    assert _lrs(OptimConfig(lr=1e-5, warmup_steps=5), 1) == [1e-5]  # one step: no warm-up at all
    assert logged().strip().endswith("the run's 1 optimizer steps: the warm-up is dropped; set "
                                     "optim.warmup_steps below 1 (0: no warm-up)")
    get_logger().removeHandler(caplog.handler)


def test_lr_far_from_the_known_rate_is_one_warning_and_toy_models_get_none():
    message = lr_warning(1e-4, "preference", False, SMOLLM2_PARAMETERS)
    assert message == ("optim.lr=0.0001 is 100x above the 1e-06 known to work for full-weight preference on a "
                       "134M-parameter model (the SmolLM2-135M recipe, TRL's DPOConfig default): it can wreck the "
                       "model's general answers in a few steps; see aligner/conf/recipes/")
    assert lr_warning(1e-8, "sft", False, 7e9).startswith("optim.lr=1e-08 is 2000x below the 2e-05 known to work "
                                                          "for full-weight sft on a 7000M-parameter model")
    assert lr_warning(1e-5, "preference", False, SMOLLM2_PARAMETERS) is None  # within 10x
    assert lr_warning(3e-4, "preference", True, SMOLLM2_PARAMETERS) is None  # LoRA tolerates more
    assert lr_warning(1.0, "sft", False, 2e6) is None  # a toy model: no advice
    with pytest.raises(ValueError, match="method 'ppo' is not one of"):
        known_rate("ppo", False, SMOLLM2_PARAMETERS)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_each_recipe_loads_over_its_entry_points_yaml_at_the_rate_the_table_knows(recipe):
    schema, required = RECIPES[recipe]
    cfg = load_config(schema, CONF_DIR / "recipes" / recipe, required)
    lora = cfg.peft.scheme == "lora"
    assert lora == recipe.endswith("_lora.yaml")
    assert cfg.optim.lr == known_rate(schema.LR_METHOD, lora, SMOLLM2_PARAMETERS).lr
    assert cfg.optim.min_lr is None and cfg.optim.warmup_steps == 0
    entry_point_yaml = "gpt_reinforce_actor.yaml" if schema is RLActorConfig else f"gpt_{recipe.split('_')[1]}.yaml"
    default = load_config(schema, CONF_DIR / entry_point_yaml, required)
    # what the recipe does not set comes from the entry point's yaml
    for section in ("name", "seed", "parallel", "model", "checkpoint", "logging"):
        assert getattr(cfg, section) == getattr(default, section), section


def test_extends_errors_name_the_file_and_line(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"extends: {CONF_DIR / 'gpt_sft.yaml'}\noptim:\n  lr: 2.0e-5\n  typo: 1\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(recipe))}:4: key 'optim.typo'"):
        load_config(SFTConfig, recipe, SFT_REQUIRED)
    recipe.write_text("# a recipe\nextends: missing.yaml\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(recipe))}:2: extends {re.escape(str(tmp_path))}/missing"
                                          r".yaml, which does not exist$"):
        load_config(SFTConfig, recipe, SFT_REQUIRED)
    recipe.write_text("extends: recipe.yaml\n")
    with pytest.raises(ConfigError, match=r"extends .*recipe.yaml, which extends it back \(a cycle\)$"):
        load_config(SFTConfig, recipe, SFT_REQUIRED)
    recipe.write_text(f"extends: {CONF_DIR / 'gpt_sft.yaml'}\ntrainer:\n  max_steps: -3\n")
    with pytest.raises(ConfigError, match=r"^trainer.max_steps=-3 is out of range"):
        load_config(SFTConfig, recipe, SFT_REQUIRED)
