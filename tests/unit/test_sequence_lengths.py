"""Rows longer than the model's positions are refused by every trainer before the model is built.

Each entry point's build function runs in this process on a checkpoint whose `aligner_meta.json` says
128 positions (no weights: the refusal comes before anything would load them), with settings that make
its rows 512 tokens. The entry-point script itself is run in tests/unit/test_entry_point_errors.py.
"""
from __future__ import annotations

import pytest

from aligner.algorithms.distillation import KDConfig, build_kd_trainer
from aligner.algorithms.dpo import DPOConfig, build_dpo_trainer
from aligner.algorithms.kto import KTOConfig, build_kto_trainer
from aligner.algorithms.rejection_sampling import RSConfig, build_rs_run
from aligner.algorithms.reward_model import RewardModelConfig, build_reward_model_trainer
from aligner.algorithms.rl_build import build_rl_actor, build_teacher
from aligner.algorithms.rl_config import RLActorConfig
from aligner.algorithms.sft import SFTConfig, SFTDataConfig, build_sft_trainer
from aligner.algorithms.spin import SPINConfig, build_spin_run
from aligner.config import CONF_DIR, ConfigError, load_config
from aligner.models.gpt import GPTConfig
from aligner.training.setup import DataSection

from ..conftest import write_model_meta

POSITIONS = 128
TRAIN = ["data.train=[{path: train.jsonl}]", "data.max_seq_length=512"]
PROMPTS = ["data.prompts=prompts.jsonl", "data.max_prompt_length=64"]
SEQ = r"data\.max_seq_length=512"
SFT_SEQ = r"data\.max_seq_length=512 \(511 positions, the last token a label\)"  # (collate_sft)

# (algorithm, schema, yaml, overrides beside model.init_from and checkpoint.save_dir, build, the setting named)
CASES = [
    ("sft", SFTConfig, "gpt_sft.yaml", TRAIN, build_sft_trainer, SFT_SEQ),
    ("steerlm", SFTConfig, "gpt_sft.yaml", [*TRAIN, "data.steerlm.attributes=[quality]"],
     build_sft_trainer, SFT_SEQ),
    ("dpo", DPOConfig, "gpt_dpo.yaml", TRAIN, build_dpo_trainer, SEQ),
    ("kto", KTOConfig, "gpt_kto.yaml", TRAIN, build_kto_trainer, SEQ),
    ("reward model", RewardModelConfig, "training_rm.yaml", TRAIN, build_reward_model_trainer, SEQ),
    ("distillation", KDConfig, "gpt_knowledge_distillation.yaml",
     ["data.train=[{path: train.jsonl, teacher_topk: train.topk}]", "data.max_seq_length=512"], build_kd_trainer,
     SFT_SEQ),
    ("spin", SPINConfig, "gpt_spin.yaml", [*TRAIN[:1], "data.max_seq_length=100", "spin.generation.max_new_tokens=412"],
     build_spin_run, r"data\.max_seq_length \+ spin\.generation\.max_new_tokens = 100 \+ 412 = 512"),
    ("rejection sampling", RSConfig, "gpt_rs.yaml",
     [*PROMPTS, "rs.generation.max_new_tokens=448", "reward.function=aligner.demo.arithmetic:score_response"],
     build_rs_run,
     r"data\.max_prompt_length \+ rs\.generation\.max_new_tokens = 64 \+ 448 = 512"),
    ("ppo actor", RLActorConfig, "gpt_ppo_actor.yaml", [*PROMPTS, "generation.max_new_tokens=448"], build_rl_actor,
     r"data\.max_prompt_length \+ generation\.max_new_tokens = 64 \+ 448 = 512"),
    ("reinforce actor", RLActorConfig, "gpt_reinforce_actor.yaml", [*PROMPTS, "generation.max_new_tokens=448"],
     build_rl_actor, r"data\.max_prompt_length \+ generation\.max_new_tokens = 64 \+ 448 = 512"),
]


@pytest.fixture(scope="module", params=["rope", "learned_absolute"])
def short_checkpoint(request, tmp_path_factory, arithmetic_tokenizer_dir):
    """A checkpoint of a model with 128 positions: Llama-style RoPE, or GPT-2's learned position table."""
    make = GPTConfig.llama if request.param == "rope" else GPTConfig.gpt2
    model_cfg = make(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=POSITIONS,
                     vocab_size=32)
    return write_model_meta(tmp_path_factory.mktemp(f"short_{request.param}"), model_cfg, arithmetic_tokenizer_dir)


@pytest.mark.parametrize("name, schema, yaml_name, overrides, build, setting", CASES, ids=[case[0] for case in CASES])
def test_rows_longer_than_the_positions_are_refused_before_the_model_is_built(
        tmp_path, monkeypatch, short_checkpoint, name, schema, yaml_name, overrides, build, setting):
    save_dir = tmp_path / "checkpoints"
    monkeypatch.chdir(tmp_path)  # the prompt file a reward function is probed on before the model (RS)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+2="}\n')
    cfg = load_config(schema, CONF_DIR / yaml_name, [f"model.init_from={short_checkpoint}", *overrides,
                                                     f"checkpoint.save_dir={save_dir}"])
    meta = short_checkpoint / "aligner_meta.json"
    with pytest.raises(ConfigError, match=rf"^{setting} is above {meta}'s model\.max_position_embeddings=128: "):
        build(cfg)
    assert not save_dir.exists()  # refused before the run started: nothing built, nothing written


def test_an_rl_teacher_with_fewer_positions_is_refused(short_checkpoint):
    """On-policy distillation: the teacher scores the rollouts too (checked before its chunks are built)."""
    cfg = load_config(RLActorConfig, CONF_DIR / "gpt_reinforce_actor.yaml",
                      ["model.init_from=policy", *PROMPTS, "generation.max_new_tokens=448"])
    limit = rf"teacher\.init_from={short_checkpoint}'s model\.max_position_embeddings=128"
    with pytest.raises(ConfigError, match=rf"\+ generation\.max_new_tokens = 64 \+ 448 = 512 is above {limit}: "):
        build_teacher(str(short_checkpoint), cfg.parallel, None, cfg.sequence_lengths())


def test_a_random_init_names_its_architecture_key(tmp_path, arithmetic_tokenizer_dir):
    cfg = load_config(SFTConfig, CONF_DIR / "gpt_sft.yaml", [
        *TRAIN, f"tokenizer.path={arithmetic_tokenizer_dir}", "model.architecture.max_position_embeddings=256",
        f"checkpoint.save_dir={tmp_path / 'checkpoints'}"])
    with pytest.raises(ConfigError, match=rf"^{SFT_SEQ} is above model\.architecture\.max_position_embeddings=256: "):
        build_sft_trainer(cfg)


def test_rows_up_to_the_positions_are_accepted():
    model_cfg = GPTConfig.gpt2(max_position_embeddings=POSITIONS)
    model_cfg.check_sequence_lengths([(POSITIONS, "data.max_seq_length=128")], "model.max_position_embeddings")
    with pytest.raises(ConfigError, match=r"^data\.max_seq_length=129 is above model\.max_position_embeddings=128"):
        model_cfg.check_sequence_lengths([(POSITIONS + 1, "data.max_seq_length=129")], "model.max_position_embeddings")



def test_an_sft_row_takes_one_position_less_than_its_tokens():
    """SFT and distillation feed tokens[:-1] (the last token is only a label): positions + 1 tokens fit."""
    model_cfg = GPTConfig.gpt2(max_position_embeddings=POSITIONS)
    model_cfg.check_sequence_lengths([SFTDataConfig(max_seq_length=POSITIONS + 1).sequence_length], "limit")
    with pytest.raises(ConfigError, match=r"^data\.max_seq_length=130 \(129 positions"):
        model_cfg.check_sequence_lengths([SFTDataConfig(max_seq_length=POSITIONS + 2).sequence_length], "limit")
    with pytest.raises(ConfigError, match=r"^data\.max_seq_length=129 is above limit=128"):  # DPO, KTO, RM rows
        model_cfg.check_sequence_lengths([DataSection(max_seq_length=POSITIONS + 1).sequence_length], "limit")
