"""Checkpoint directories: atomic saves, retention, errors, exact reload."""
from __future__ import annotations

import json

import pytest
import torch

from aligner import checkpointing
from aligner.models.forward import forward_logits
from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
from aligner.runtime import seeds


pytestmark = pytest.mark.usefixtures("single_process")


def _model(seed):
    seeds.set_seed(seed)
    cfg = GPTConfig.gpt2(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=50, max_position_embeddings=16)
    return cfg, build_gpt_model(cfg, transformer_config(cfg))


def test_save_load_roundtrip_and_retention(tmp_path):
    cfg, model = _model(0)
    tokens = torch.randint(0, 50, (2, 8))
    expected = forward_logits([model], tokens, 50)
    for step in (1, 2, 3):
        checkpointing.save(checkpointing.step_dir(tmp_path, step), [model], model_config=cfg.to_dict(),
                           trainer_state={"step": step})
        checkpointing.remove_old_checkpoints(tmp_path, keep_last=2)
    assert [step for step, _ in checkpointing.step_checkpoints(tmp_path)] == [2, 3]
    assert not list(tmp_path.glob("*.incomplete"))
    latest = checkpointing.latest_checkpoint(tmp_path)
    assert latest.name == "step_00000003"

    _, other = _model(1)
    assert not torch.allclose(forward_logits([other], tokens, 50), expected)
    meta = checkpointing.load(latest, [other])
    assert meta["trainer_state"] == {"step": 3}
    assert GPTConfig.from_dict(meta["model"]) == cfg
    assert torch.equal(forward_logits([other], tokens, 50), expected)


def test_incomplete_and_foreign_directories_are_ignored_or_rejected(tmp_path):
    cfg, model = _model(0)
    checkpointing.save(checkpointing.step_dir(tmp_path, 5), [model], model_config=cfg.to_dict())
    # A crash mid-save leaves only a staging directory: it is never picked up for resume.
    (tmp_path / "step_00000009.incomplete").mkdir()
    (tmp_path / "step_00000010").mkdir()  # no meta file: not a complete checkpoint
    assert checkpointing.latest_checkpoint(tmp_path).name == "step_00000005"
    with pytest.raises(checkpointing.CheckpointError, match="not an aligner checkpoint"):
        checkpointing.read_meta(tmp_path / "step_00000010")
    (tmp_path / "step_00000010" / checkpointing.META_FILE).write_text(json.dumps({"format": "other"}))
    with pytest.raises(checkpointing.CheckpointError, match="unknown checkpoint format"):
        checkpointing.read_meta(tmp_path / "step_00000010")
    with pytest.raises(checkpointing.CheckpointError, match="no optimizer state"):
        checkpointing.load(checkpointing.step_dir(tmp_path, 5), [model], optimizer=object())
