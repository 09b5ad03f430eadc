"""Config loading: schema-checked yaml, key=value overrides, unknown keys are errors."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from aligner.algorithms.distillation import KDConfig, TeacherTopKConfig
from aligner.algorithms.dpo import DPOConfig
from aligner.algorithms.kto import KTOConfig
from aligner.algorithms.rejection_sampling import RSConfig
from aligner.algorithms.reward_model import RewardModelConfig
from aligner.algorithms.rl_config import RLActorConfig
from aligner.algorithms.sft import SFTConfig
from aligner.algorithms.spin import SPINConfig
from aligner.config import CONF_DIR, ConfigError, at_least, composed_config, load_config, one_of, parse_command_line
from aligner.training.run import run_training
from servers.critic import CriticServerConfig

from ..conftest import dotted_keys

SFT_YAML = CONF_DIR / "gpt_sft.yaml"


def test_shipped_yaml_loads_and_overrides_apply():
    cfg = load_config(SFTConfig, SFT_YAML,
                      ["trainer.max_steps=7", "optim.lr=0.5", "data.train=[{path: a.jsonl, weight: 2}]"])
    assert cfg.trainer.max_steps == 7
    assert cfg.optim.lr == 0.5
    assert cfg.data.train[0].path == "a.jsonl" and cfg.data.train[0].weight == 2.0
    assert cfg.model.architecture.normalization == "RMSNorm"


ENTRY_POINT_CONFIGS = [
    (SFTConfig, "gpt_sft.yaml", ("data.train=[{path: x.jsonl}]",)),
    (RewardModelConfig, "training_rm.yaml", ("data.train=[{path: x.jsonl}]",)),
    (CriticServerConfig, "gpt_ppo_critic.yaml", ("critic.init_from=/checkpoint",)),
    (RLActorConfig, "gpt_ppo_actor.yaml", ("data.prompts=p.jsonl", "model.init_from=/checkpoint")),
    (RLActorConfig, "gpt_reinforce_actor.yaml", ("data.prompts=p.jsonl", "model.init_from=/checkpoint")),
    (DPOConfig, "gpt_dpo.yaml", ("data.train=[{path: x.jsonl}]", "model.init_from=/checkpoint")),
    (SPINConfig, "gpt_spin.yaml", ("data.train=[{path: x.jsonl}]", "model.init_from=/checkpoint")),
    (KTOConfig, "gpt_kto.yaml", ("data.train=[{path: x.jsonl}]", "model.init_from=/checkpoint")),
    (RSConfig, "gpt_rs.yaml", ("data.prompts=p.jsonl", "model.init_from=/checkpoint")),
    (KDConfig, "gpt_knowledge_distillation.yaml", ("data.train=[{path: x.jsonl, teacher_topk: x.topk}]",)),
    (TeacherTopKConfig, "teacher_topk.yaml", ("teacher=/checkpoint", "data.path=x.jsonl", "output=x.topk")),
]


@pytest.mark.parametrize("schema, yaml_name, required", ENTRY_POINT_CONFIGS)
def test_every_schema_key_is_in_the_shipped_yaml(schema, yaml_name, required):
    """The yaml documents every key the entry point reads, and loads against its schema."""
    from omegaconf import OmegaConf

    schema_keys = dotted_keys(OmegaConf.structured(schema))
    in_yaml = dotted_keys(composed_config(CONF_DIR / yaml_name))  # with the bases it extends
    assert schema_keys - in_yaml == set(), f"keys missing from aligner/conf/{yaml_name}"
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


@pytest.mark.parametrize("text, message", [
    ("data:\n  train:\n    path: x.jsonl\n",
     r":2: key 'data.train' is a mapping \(key: value\); expected a list"),
    ("data:\n  train: 5\n", r":2: key 'data.train' is the value 5; expected a list"),  # a path is a shorthand
    ("name: run\ntrainer: [1, 2]\n", r":2: key 'trainer' is a list; expected a section of keys \(max_steps, "),
    ("data: 5\n", r":1: key 'data' is the value 5; expected a section of keys"),
    ("trainer:\n  max_steps:\n    value: 3\n", r":2: key 'trainer.max_steps' is a mapping .*expected a single value"),
    ("data:\n  train: [[x.jsonl]]\n", r":2: key 'data.train\[0\]' is a list; expected a section of keys \(path"),
    ("data:\n  train:\n    - path: a.jsonl\n    - path: b.jsonl\n      weight: heavy\n",
     r":5: key 'data.train\[1\].weight': Value 'heavy' .*Float"),
    ("trainer:\n  max_steps: many\n", r":2: key 'trainer.max_steps': Value 'many'"),
])
def test_a_config_file_value_of_the_wrong_kind_is_one_line_naming_file_line_and_key(tmp_path, text, message):
    """omegaconf's merge raises a bare TypeError for a mapping where a list belongs, and names no key
    for a value where a section belongs."""
    config = tmp_path / "config.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{config}{message}") as error:
        load_config(SFTConfig, config)
    assert "\n" not in str(error.value)


def test_the_same_mistakes_on_the_command_line_are_labelled_command_line():
    for override, message in (("data.train={path: x.jsonl}", "key 'data.train' is a mapping"),
                              ("trainer.max_steps=[3]", "key 'trainer.max_steps' is a list"),
                              ("data.train=[{path: x, weight: heavy}]", r"key 'data.train\[0\].weight': Value")):
        with pytest.raises(ConfigError, match=rf"^command-line override: {message}"):
            load_config(SFTConfig, SFT_YAML, [override])


def test_unset_variables_and_missing_values_are_labelled_with_where_they_are_set(tmp_path, monkeypatch):
    monkeypatch.delenv("ALIGNER_TEST_UNSET", raising=False)
    config = tmp_path / "config.yaml"
    config.write_text("name: run\ndata:\n  train:\n    - path: ${oc.env:ALIGNER_TEST_UNSET}\n")
    with pytest.raises(ConfigError, match=rf"^{config}:4: key 'data.train\[0\].path': .*ALIGNER_TEST_UNSET"):
        load_config(SFTConfig, config)
    config.write_text("name: run\ntokenizer:\n  path: ${nowhere}\n")
    with pytest.raises(ConfigError, match=rf"^{config}:3: key 'tokenizer.path': Interpolation key 'nowhere'"):
        load_config(SFTConfig, config, ["data.train=[{path: x.jsonl}]"])
    with pytest.raises(ConfigError, match=r"^command-line override: key 'tokenizer.path': .*ALIGNER_TEST_UNSET"):
        load_config(SFTConfig, SFT_YAML,
                    ["data.train=[{path: x.jsonl}]", "tokenizer.path=${oc.env:ALIGNER_TEST_UNSET}"])
    # The shipped yaml's `path: ???` left unset: the line to fill in (or the key to set).
    line = SFT_YAML.read_text().splitlines().index("    - path: ???") + 1
    with pytest.raises(ConfigError, match=rf"^{SFT_YAML}:{line}: key 'data.train\[0\].path': .*missing mandatory"):
        load_config(SFTConfig, SFT_YAML)
    with pytest.raises(ConfigError, match=r"^command-line override: key 'data.train\[0\].path': .*missing mandatory"):
        load_config(SFTConfig, SFT_YAML, ["data.train=[{weight: 2}]"])


def test_command_line_parsing():
    path, overrides = parse_command_line("default.yaml", ["--config", "x.yaml", "a=1", "b.c=2"])
    assert str(path) == "x.yaml" and overrides == ["a=1", "b.c=2"]
    path, overrides = parse_command_line("default.yaml", ["--config=y.yaml"])
    assert str(path) == "y.yaml" and overrides == []


# ----------------------------------------------------------------------------- --help
def _help_lines(capsys, schema, yaml_path) -> list[str]:
    with pytest.raises(SystemExit) as stop:
        parse_command_line("elsewhere.yaml", ["--help", "a=1", "--config", str(yaml_path)], schema=schema)
    assert stop.value.code == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("schema, yaml_name, required", ENTRY_POINT_CONFIGS)
def test_help_lists_every_key_with_the_config_files_default(capsys, schema, yaml_name, required):
    import yaml
    from omegaconf import OmegaConf

    lines = _help_lines(capsys, schema, CONF_DIR / yaml_name)
    shown = {line.split(" = ", 1)[0].strip(): line.split(" = ", 1)[1] for line in lines if line.startswith("  ")}
    keys = dotted_keys(OmegaConf.structured(schema))
    leaves = {key for key in keys if not any(other.startswith(key + ".") for other in keys)}
    assert set(shown) == leaves
    # The default shown is the value the entry point runs with when the key is not set (required ones: ???).
    cfg = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(schema), composed_config(CONF_DIR / yaml_name)))
    for key, text in shown.items():
        value = cfg
        for part in key.split("."):
            value = value[part]
        assert yaml.safe_load(text.split("  # ", 1)[0]) == value, key


def test_help_shows_defaults_and_comments_from_the_file_and_the_schema(capsys, tmp_path):
    """`key = default  # comment`: the file's comment (else the field's, above it and after it), with the
    field's allowed values; the file's value is the default."""
    path = tmp_path / "help.yaml"
    path.write_text("section:\n  rate: 0.25   # set here for the test\nname: y\n")
    lines = _help_lines(capsys, _HelpConfig, path)
    assert lines[0].startswith("usage: ") and str(path) in lines[1]
    assert "  section.rate = 0.25  # set here for the test; >= 0.0" in lines
    assert "  section.mode = a  # how it runs: the first one; one of a | b" in lines
    assert "  section.limit = null  # >= 1; null: no limit" in lines
    assert "  name = y  # the run's name" in lines


def test_help_of_a_training_entry_point_lists_optim_lr(capsys):
    from aligner.algorithms.sft import build_sft_trainer

    with pytest.raises(SystemExit) as stop:
        run_training(SFTConfig, "gpt_sft.yaml", build_sft_trainer, argv=["--help"])
    assert stop.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    import yaml

    lr = load_config(SFTConfig, SFT_YAML, ["data.train=[{path: x.jsonl}]"]).optim.lr
    shown = next(line for line in lines if line.startswith("  optim.lr = "))
    assert yaml.safe_load(shown.removeprefix("  optim.lr = ").split("  # ")[0]) == lr
    max_steps = next(line for line in lines if line.startswith("  trainer.max_steps = "))
    assert "0: no training step" in max_steps  # its comment


@dataclass
class _HelpSection:
    rate: float = at_least(0.0, 0.5)  # overridden by the file's comment
    # how it runs:
    mode: str = one_of(("a", "b"), "a")  # the first one
    limit: int | None = at_least(1, None, "null: no limit")


@dataclass
class _HelpConfig:
    section: _HelpSection = field(default_factory=_HelpSection)
    name: str = "x"  # the run's name


# ----------------------------------------------------------------------------- renamed keys
@dataclass
class _Rollout:
    prompts_per_step: int = 4
    samples_per_prompt: int = 1

@dataclass
class _RenamedSchema:
    RENAMED_KEYS: ClassVar[tuple] = (("ppo.prompts_per_step", "rollout.prompts_per_step"),
                                     ("rm_model_file", "init_from"))
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


def choice_fields(node, prefix: str = "") -> dict[str, tuple]:
    """{dotted key: choices} of every `one_of` field of a schema instance, nested sections included."""
    import dataclasses

    found = {}
    for spec in dataclasses.fields(node):
        key, value = prefix + spec.name, getattr(node, spec.name)
        if "choices" in spec.metadata:
            found[key] = spec.metadata["choices"]
        if dataclasses.is_dataclass(value):
            found.update(choice_fields(value, key + "."))
    return found


def _entry_point_schemas():
    from aligner.generation.chat import ChatConfig
    from servers.reward_model import RewardServerConfig

    return [  # every entry point's yaml but the RL actors' and the critic's
        (SFTConfig, "gpt_sft.yaml", ["data.train=[{path: x.jsonl}]"]),
        (DPOConfig, "gpt_dpo.yaml", ["data.train=[{path: x.jsonl}]"]),
        (SPINConfig, "gpt_spin.yaml", ["data.train=[{path: x.jsonl}]"]),
        (KTOConfig, "gpt_kto.yaml", ["data.train=[{path: x.jsonl}]"]),
        (RSConfig, "gpt_rs.yaml", ["data.prompts=p.jsonl"]),
        (KDConfig, "gpt_knowledge_distillation.yaml", ["data.train=[{path: x.jsonl, teacher_topk: x.topk}]"]),
        (TeacherTopKConfig, "teacher_topk.yaml", ["teacher=/c", "data.path=x.jsonl", "output=x.topk"]),
        (RewardModelConfig, "training_rm.yaml", ["data.train=[{path: x.jsonl}]"]),
        (ChatConfig, "chat.yaml", ["init_from=/checkpoint"]),
        (RewardServerConfig, "inference_rm.yaml", ["rm_model_file=/checkpoint"]),
    ]


def test_the_entry_point_list_covers_conf():
    covered = {yaml_name for _, yaml_name, _ in _entry_point_schemas()}
    owned_elsewhere = {"gpt_ppo_actor.yaml", "gpt_reinforce_actor.yaml", "gpt_ppo_critic.yaml"}
    bases = {"base.yaml", "base_gpt.yaml", "gpt_rl_actor.yaml"}  # composed into the others, never loaded alone
    assert covered | owned_elsewhere | bases == {path.name for path in CONF_DIR.glob("*.yaml")}


@pytest.mark.parametrize("schema, yaml_name, required", _entry_point_schemas(),
                         ids=lambda value: getattr(value, "__name__", None))
def test_every_choice_field_refuses_a_bogus_value_when_the_config_loads(schema, yaml_name, required):
    """A typo in a choice field fails in load_config (before any model is built), naming the dotted key."""
    import re

    load_config(schema, CONF_DIR / yaml_name, required)  # the shipped values are valid
    choices = choice_fields(schema())
    assert {"precision", "model.architecture.activation"} & set(choices) or yaml_name == "inference_rm.yaml"
    for key, allowed in choices.items():
        assert "bogus_choice" not in allowed
        refusal = rf"^{re.escape(key)}='bogus_choice' is not one of {re.escape(', '.join(allowed))}$"
        with pytest.raises(ConfigError, match=refusal):
            load_config(schema, CONF_DIR / yaml_name, [*required, f"{key}=bogus_choice"])


def test_chat_checkpoint_is_now_init_from(tmp_path, capsys):
    """chat.py's old `checkpoint=` still loads (with a deprecation line) as `init_from`, which the loader reads."""
    import contextlib

    from aligner.generation.chat import ChatConfig, load_chat_model

    chat_yaml = CONF_DIR / "chat.yaml"
    cfg = load_config(ChatConfig, chat_yaml, [f"checkpoint={tmp_path / 'old_name'}"])
    assert cfg.init_from == str(tmp_path / "old_name") and not hasattr(cfg, "checkpoint")
    assert "deprecated: the command line sets checkpoint; it is now init_from" in capsys.readouterr().err
    old_yaml = tmp_path / "old_chat.yaml"
    old_yaml.write_text(chat_yaml.read_text().replace("init_from: ???", "checkpoint: /from/the/file"))
    assert load_config(ChatConfig, old_yaml).init_from == "/from/the/file"
    assert f"deprecated: {old_yaml} sets checkpoint; it is now init_from" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="checkpoint is the old name of init_from; set only init_from"):
        load_config(ChatConfig, chat_yaml, ["checkpoint=/a", "init_from=/b"])
    with (contextlib.ExitStack() as stack,
          pytest.raises(ConfigError, match=rf"^init_from={tmp_path / 'old_name'} does not exist")):
        load_chat_model(cfg, stack)


# ----------------------------------------------------------------------------- composition: bases and overlays
COMPOSED = [(schema, yaml_name, required) for schema, yaml_name, required in ENTRY_POINT_CONFIGS
            if "extends" in (CONF_DIR / yaml_name).read_text()]


def test_the_entry_points_yamls_are_composed_from_the_bases():
    assert {yaml_name for _, yaml_name, _ in COMPOSED} >= {
        "gpt_sft.yaml", "gpt_dpo.yaml", "gpt_kto.yaml", "gpt_rs.yaml", "gpt_spin.yaml", "training_rm.yaml",
        "gpt_knowledge_distillation.yaml", "gpt_ppo_actor.yaml", "gpt_reinforce_actor.yaml"}
    from aligner.config import _config_files

    chains = {name: [path.name for path, _ in _config_files(CONF_DIR / name)] for _, name, _ in COMPOSED}
    assert chains["gpt_sft.yaml"] == ["base.yaml", "base_gpt.yaml", "gpt_sft.yaml"]
    assert chains["gpt_ppo_actor.yaml"] == ["base.yaml", "gpt_rl_actor.yaml", "gpt_ppo_actor.yaml"]
    assert chains["gpt_reinforce_actor.yaml"] == ["base.yaml", "gpt_rl_actor.yaml", "gpt_reinforce_actor.yaml"]


@pytest.mark.parametrize("schema, yaml_name, required", COMPOSED)
def test_a_composed_yaml_loads_as_the_one_complete_file_a_user_would_write(tmp_path, schema, yaml_name, required):
    """A user's own complete yaml (`--config`, no `extends`) written out from the composed one gives the same
    config: composing the bases changes nothing a flat file would set."""
    import dataclasses

    from omegaconf import OmegaConf

    flat = tmp_path / yaml_name
    flat.write_text(OmegaConf.to_yaml(composed_config(CONF_DIR / yaml_name)))
    assert "extends" not in flat.read_text()
    assert (dataclasses.asdict(load_config(schema, flat, list(required)))
            == dataclasses.asdict(load_config(schema, CONF_DIR / yaml_name, list(required))))


def test_an_overlay_sets_only_what_its_base_does_not_already_say():
    """Thin overlays: no key of a composed yaml repeats the value and the comment the files it extends give."""
    from omegaconf import OmegaConf

    from aligner.config import _config_files, _yaml_comments

    from ..conftest import dotted_keys

    repeated = []
    for path in sorted(CONF_DIR.glob("*.yaml")):
        files = _config_files(path)
        if len(files) < 2:
            continue
        above = OmegaConf.merge(*(node for _, node in files[:-1]))
        comments = {}
        for above_path, _ in files[:-1]:
            comments.update(_yaml_comments(above_path.read_text()))
        own, own_comments = files[-1][1], _yaml_comments(path.read_text())
        for key in dotted_keys(own):
            value = OmegaConf.select(own, key)
            if OmegaConf.is_dict(value) and len(value):
                continue  # a section: its keys are checked one by one
            if (key in dotted_keys(above) and OmegaConf.select(above, key) == value
                    and own_comments.get(key) == comments.get(key)):
                repeated.append(f"{path.name}: {key}")
    assert repeated == []


def test_a_bad_key_in_a_base_names_the_base_and_its_line(tmp_path):
    import shutil

    copy = tmp_path / "conf"
    shutil.copytree(CONF_DIR, copy)
    base = copy / "base.yaml"
    base.write_text(base.read_text().replace("  save_at_end: true\n", "  save_at_end: true\n  keep_lots: 3\n"))
    line = base.read_text().splitlines().index("  keep_lots: 3") + 1
    with pytest.raises(ConfigError, match=rf"^{base}:{line}: .*checkpoint.keep_lots"):
        load_config(SFTConfig, copy / "gpt_sft.yaml", ["data.train=[{path: x.jsonl}]"])


def test_a_copied_entry_point_yaml_finds_its_base_among_the_shipped_configs(tmp_path):
    """`extends: base_gpt.yaml` in a copy outside conf/ (nothing beside it): the shipped base."""
    import dataclasses

    mine = tmp_path / "my_sft.yaml"
    mine.write_text(SFT_YAML.read_text().replace("max_steps: 100", "max_steps: 7"))
    required = ["data.train=[{path: x.jsonl}]"]
    expected = dataclasses.asdict(load_config(SFTConfig, SFT_YAML, required + ["trainer.max_steps=7"]))
    assert dataclasses.asdict(load_config(SFTConfig, mine, required)) == expected
    (tmp_path / "base_gpt.yaml").write_text("extends: base.yaml\nseed: 5\n")  # one beside it wins
    assert load_config(SFTConfig, mine, required).seed == 5


def test_the_algorithm_presets_are_the_yaml_files_users_copy(tmp_path):
    """`algorithm=NAME` is conf/algorithms/NAME.yaml: the same keys as that file, loaded as a --config overlay."""
    import dataclasses

    from aligner.algorithms.rl_config import ALGORITHMS, GroupRLActorConfig

    assert set(ALGORITHMS) == {path.stem for path in (CONF_DIR / "algorithms").glob("*.yaml")}
    required = ["data.prompts=p.jsonl", "model.init_from=/checkpoint"]
    for name in ("grpo", "dapo", "gspo"):
        overlay = tmp_path / f"my_{name}.yaml"  # the preset copied into a user's yaml over the shipped one
        preset = (CONF_DIR / "algorithms" / f"{name}.yaml").read_text()
        overlay.write_text(f"extends: gpt_reinforce_actor.yaml\n{preset}")
        by_name = load_config(GroupRLActorConfig, CONF_DIR / "gpt_reinforce_actor.yaml",
                              required + [f"algorithm={name}"])
        by_copy = load_config(GroupRLActorConfig, overlay, required)
        assert dataclasses.asdict(by_copy) == {**dataclasses.asdict(by_name), "algorithm": None}
