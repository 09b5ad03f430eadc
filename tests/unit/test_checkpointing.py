"""Checkpoint directories: atomic saves, retention by run, manifests, start-up checks, exact reload."""
from __future__ import annotations

import errno
import hashlib
import json
import os
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from aligner import checkpointing
from aligner.models.forward import forward_logits
from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
from aligner.runtime import run_lock, seeds

pytestmark = pytest.mark.usefixtures("single_process")


def _model(seed):
    seeds.set_seed(seed)
    cfg = GPTConfig.gpt2(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=50, max_position_embeddings=16)
    return cfg, build_gpt_model(cfg, transformer_config(cfg))


def _save(directory: Path, step: int, model, cfg, run_id="run-a") -> Path:
    return checkpointing.save(checkpointing.step_dir(directory, step), [model], model_config=cfg.to_dict(),
                              trainer_state={"step": step}, run_id=run_id)


def _largest_shard(checkpoint: Path) -> Path:
    return max(checkpoint.glob("*.distcp"), key=lambda path: path.stat().st_size)


def test_save_load_roundtrip_and_retention(tmp_path):
    cfg, model = _model(0)
    tokens = torch.randint(0, 50, (2, 8))
    expected = forward_logits([model], tokens, 50)
    for step in (1, 2, 3):
        saved = _save(tmp_path, step, model, cfg)
        checkpointing.remove_old_checkpoints(tmp_path, keep_last=2, run_id="run-a", saved=saved)
    assert [step for step, _ in checkpointing.step_checkpoints(tmp_path)] == [2, 3]
    assert not list(tmp_path.glob("*.incomplete"))
    latest = checkpointing.latest_checkpoint(tmp_path)
    assert latest.name == "step_00000003"

    _, other = _model(1)
    assert not torch.allclose(forward_logits([other], tokens, 50), expected)
    meta = checkpointing.load(latest, [other])
    assert meta["trainer_state"] == {"step": 3}
    assert meta["run_id"] == "run-a"
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
    meta_file = tmp_path / "step_00000010" / checkpointing.META_FILE
    meta_file.write_text('{\n  "format": "aligner-megatron-v1",\n  "model": {"num_l')  # cut short by a full disk
    with pytest.raises(checkpointing.CheckpointError, match=f"^{meta_file}:3: not valid JSON"):
        checkpointing.read_meta(tmp_path / "step_00000010")
    meta_file.write_text("[1, 2]")
    with pytest.raises(checkpointing.CheckpointError, match="unknown checkpoint format 'a JSON list'"):
        checkpointing.read_meta(tmp_path / "step_00000010")
    with pytest.raises(checkpointing.CheckpointError, match="no optimizer state"):
        checkpointing.load(checkpointing.step_dir(tmp_path, 5), [model], optimizer=object())


# ----------------------------------------------------------------------------- pruning by run
def test_pruning_deletes_only_this_runs_older_checkpoints(tmp_path):
    cfg, model = _model(0)
    _save(tmp_path, 40, model, cfg, run_id="other")  # another run's, with a higher step
    _save(tmp_path, 3, model, cfg, run_id="other")
    checkpointing.save(checkpointing.step_dir(tmp_path, 4), [model], model_config=cfg.to_dict())  # no run id
    _save(tmp_path, 30, model, cfg, run_id="mine")  # ours, newer than the save below: kept (a later save replaces it)
    for step in (5, 6, 7):
        saved = _save(tmp_path, step, model, cfg, run_id="mine")
        checkpointing.remove_old_checkpoints(tmp_path, keep_last=2, run_id="mine", saved=saved)
        assert saved.is_dir()  # never the checkpoint just written, whatever sorts after it
    assert [step for step, _ in checkpointing.step_checkpoints(tmp_path)] == [3, 4, 6, 7, 30, 40]
    checkpointing.remove_old_checkpoints(tmp_path, keep_last=1, run_id="mine",
                                         saved=checkpointing.step_dir(tmp_path, 7))
    assert [step for step, _ in checkpointing.step_checkpoints(tmp_path)] == [3, 4, 7, 30, 40]
    checkpointing.remove_old_checkpoints(tmp_path, keep_last=0, run_id="mine",
                                         saved=checkpointing.step_dir(tmp_path, 30))
    assert [step for step, _ in checkpointing.step_checkpoints(tmp_path)] == [3, 4, 7, 30, 40]


# ----------------------------------------------------------------------------- manifest
def test_manifest_lists_every_final_file_with_its_size_and_sha256(tmp_path):
    cfg, model = _model(0)
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    checkpoint = checkpointing.save(tmp_path / "step_00000001", [model], model_config=cfg.to_dict(),
                                    tokenizer_dir=tokenizer, save_rng=True)
    manifest = json.loads((checkpoint / checkpointing.MANIFEST_FILE).read_text())
    on_disk = {path.relative_to(checkpoint).as_posix(): path for path in checkpoint.rglob("*") if path.is_file()}
    assert set(manifest["files"]) == set(on_disk) - {checkpointing.MANIFEST_FILE}
    assert {"aligner_meta.json", "tokenizer/tokenizer.json", "common.pt", ".metadata"} <= set(manifest["files"])
    for name, entry in manifest["files"].items():
        data = on_disk[name].read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert checkpointing.verify(checkpoint) is None


@pytest.mark.parametrize("damage, cause", [
    ("truncate", r"__0_\d\.distcp is truncated to 100 of \d+ bytes"),
    ("delete", r"__0_\d\.distcp is missing"),
    ("flip", r"__0_\d\.distcp fails its sha256 check"),
    ("meta", r"aligner_meta\.json fails its sha256 check"),
])
def test_damaged_files_are_reported_with_their_real_cause(tmp_path, damage, cause):
    cfg, model = _model(0)
    checkpoint = _save(tmp_path, 1, model, cfg)
    shard = _largest_shard(checkpoint)
    if damage == "truncate":
        os.truncate(shard, 100)
    elif damage == "delete":
        shard.unlink()
    elif damage == "flip":  # one byte in the middle of the tensor data, the size unchanged
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:
        meta = json.loads((checkpoint / checkpointing.META_FILE).read_text())
        meta["trainer_state"]["step"] = 2
        (checkpoint / checkpointing.META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    assert checkpointing.verify(checkpoint) is not None
    _, other = _model(1)
    with pytest.raises(checkpointing.CheckpointError, match=rf"{checkpoint} is damaged: {cause}") as raised:
        checkpointing.load(checkpoint, [other])
    assert "right kind of checkpoint" not in str(raised.value)


def test_checkpoints_without_manifest_load_unchecked(tmp_path):
    cfg, model = _model(0)
    tokens = torch.randint(0, 50, (2, 8))
    checkpoint = _save(tmp_path, 1, model, cfg)
    (checkpoint / checkpointing.MANIFEST_FILE).unlink()
    assert checkpointing.verify(checkpoint) is None
    _, other = _model(1)
    checkpointing.load(checkpoint, [other])
    assert torch.equal(forward_logits([other], tokens, 50), forward_logits([model], tokens, 50))
    # Without a manifest a missing shard is still named as damage, not as the wrong kind of checkpoint.
    _largest_shard(checkpoint).unlink()
    with pytest.raises(checkpointing.CheckpointError, match=r"is damaged: FileNotFoundError.*distcp"):
        checkpointing.load(checkpoint, [other])


def test_a_real_kind_mismatch_keeps_the_kind_message(tmp_path):
    cfg, model = _model(0)
    checkpoint = _save(tmp_path, 1, model, cfg)
    wider = GPTConfig.gpt2(num_layers=3, hidden_size=32, num_attention_heads=2, vocab_size=50,
                           max_position_embeddings=16)
    with pytest.raises(checkpointing.CheckpointError, match="right kind of checkpoint"):
        checkpointing.load(checkpoint, [build_gpt_model(wider, transformer_config(wider))])


def test_another_architecture_is_one_line_naming_the_checkpoint_and_what_differs(tmp_path):
    cfg, model = _model(0)
    checkpoint = _save(tmp_path, 1, model, cfg)
    wider = GPTConfig.gpt2(num_layers=2, hidden_size=64, num_attention_heads=2, vocab_size=50,
                           max_position_embeddings=16)
    with pytest.raises(checkpointing.CheckpointError) as raised:
        checkpointing.load(checkpoint, [build_gpt_model(wider, transformer_config(wider))],
                           model_config=wider.to_dict())
    assert str(raised.value) == (f"{checkpoint} holds a model of another architecture than this run's (hidden_size: "
                                 "32 in the checkpoint, 64 here): give this run the settings the checkpoint was "
                                 "saved with, or another checkpoint")
    deeper = GPTConfig.gpt2(num_layers=3, hidden_size=32, num_attention_heads=2, vocab_size=50,
                            max_position_embeddings=16)
    with pytest.raises(checkpointing.CheckpointError) as raised:  # without this run's settings: the tensor's shapes
        checkpointing.load(checkpoint, [build_gpt_model(deeper, transformer_config(deeper))])
    assert "CheckpointException" not in str(raised.value)
    assert str(raised.value).startswith(f"{checkpoint}: cannot load it into this model (decoder.layers.")
    assert "has shape [2, 32] in the checkpoint, [3, 32] in this model)" in str(raised.value)


def test_a_save_never_replaces_another_runs_checkpoint(tmp_path):
    cfg, model = _model(0)
    theirs = _save(tmp_path, 5, model, cfg, run_id="run-a")
    before = {path.relative_to(theirs): path.read_bytes() for path in theirs.rglob("*") if path.is_file()}
    with pytest.raises(checkpointing.CheckpointError) as raised:
        _save(tmp_path, 5, model, cfg, run_id="run-b")
    kept = tmp_path / "step_00000005.run_run-b"
    assert str(raised.value) == (f"cannot save {theirs}: it holds a checkpoint of another run (run-a), which is not "
                                 f"deleted; this run (run-b) saved its checkpoint as {kept}: is another process "
                                 "writing to this checkpoint.save_dir?")
    assert {path.relative_to(theirs): path.read_bytes() for path in theirs.rglob("*") if path.is_file()} == before
    assert checkpointing.verify(kept) is None and checkpointing.read_meta(kept)["run_id"] == "run-b"
    assert [path for _, path in checkpointing.step_checkpoints(tmp_path)] == [theirs]
    _save(tmp_path, 5, model, cfg, run_id="run-a")  # the run's own checkpoint of that step is replaced


def test_files_are_split_over_ranks_by_size():
    sizes = [900, 10, 500, 500, 40, 300, 0, 7]
    for world in (1, 2, 3, 8, 11):
        owners = checkpointing.manifest._owners(sizes, world)
        assert len(owners) == len(sizes) and all(0 <= owner < world for owner in owners)
        loads = [sum(size for size, owner in zip(sizes, owners) if owner == rank) for rank in range(world)]
        # Greedy largest-first: no rank holds more than the ideal share plus the largest file.
        assert max(loads) <= sum(sizes) / world + max(sizes), (world, loads)
    split = checkpointing.manifest._owners
    assert split(sizes, 2) == split(list(sizes), 2)  # the same on every rank


# ----------------------------------------------------------------------------- resume choice
def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path):
    cfg, model = _model(0)
    for step in (1, 2, 3):
        _save(tmp_path, step, model, cfg)
    os.truncate(_largest_shard(checkpointing.step_dir(tmp_path, 3)), 10)
    _largest_shard(checkpointing.step_dir(tmp_path, 2)).unlink()
    lines = []
    chosen = checkpointing.latest_intact_checkpoint(tmp_path, lines.append)
    assert chosen == checkpointing.step_dir(tmp_path, 1)
    assert len(lines) == 3, lines
    assert "step_00000003 is damaged" in lines[0] and "truncated to 10 of" in lines[0]
    assert "step_00000002 is damaged" in lines[1] and "is missing" in lines[1]
    assert lines[2] == f"resuming from {chosen} instead: the newest intact checkpoint"
    (chosen / checkpointing.META_FILE).write_text((chosen / checkpointing.META_FILE).read_text() + " ")
    with pytest.raises(checkpointing.CheckpointError, match="no intact checkpoint in .*checkpoint.resume=false"):
        checkpointing.latest_intact_checkpoint(tmp_path, lines.append)
    assert checkpointing.latest_intact_checkpoint(tmp_path / "empty", lines.append) is None


def test_start_run_refuses_a_used_save_dir_without_resume_and_deletes_nothing(tmp_path):
    cfg, model = _model(0)
    _save(tmp_path, 7, model, cfg)
    before = sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*"))
    with pytest.raises(checkpointing.CheckpointError) as raised:
        checkpointing.start_run(tmp_path, resume=False, estimated_bytes=1, log=print)
    message = str(raised.value)
    assert "\n" not in message
    for part in (f"checkpoint.save_dir={tmp_path}", "step_00000007", "checkpoint.resume=true",
                 "another checkpoint.save_dir", "delete"):
        assert part in message
    after = sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*"))
    assert [path for path in after if path.name != run_lock.LOCK_FILE] == before
    assert (tmp_path / run_lock.LOCK_FILE).read_text() == ""  # the refused run let go of the lock


def test_start_run_keeps_the_resumed_run_id_and_gives_a_fresh_run_a_new_one(tmp_path):
    cfg, model = _model(0)
    fresh = checkpointing.start_run(tmp_path / "a", resume=True, estimated_bytes=1, log=print)
    assert fresh.resume_checkpoint is None and len(fresh.run_id) == 32
    assert checkpointing.start_run(tmp_path / "b", resume=False, estimated_bytes=1, log=print).run_id != fresh.run_id
    _save(tmp_path / "a", 4, model, cfg, run_id=fresh.run_id)
    (tmp_path / "a" / "step_00000006.incomplete").mkdir()  # left by a kill during a save
    lines = []
    resumed = checkpointing.start_run(tmp_path / "a", resume=True, estimated_bytes=1, log=lines.append)
    assert resumed.run_id == fresh.run_id and resumed.resume_checkpoint == checkpointing.step_dir(tmp_path / "a", 4)
    assert not (tmp_path / "a" / "step_00000006.incomplete").exists()
    assert any("step_00000006.incomplete" in line for line in lines)


def test_start_run_refuses_an_unwritable_save_dir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(checkpointing.CheckpointError, match=rf"checkpoint.save_dir={blocker}/ckpt is not writable"):
        checkpointing.start_run(blocker / "ckpt", resume=True, estimated_bytes=1, log=print)


def test_start_run_refuses_too_little_free_space(tmp_path, monkeypatch):
    cfg, model = _model(0)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpointing.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 5000, 5000))
    with pytest.raises(checkpointing.CheckpointError,
                       match=r"too little free space for a checkpoint: needs about 123,456 bytes .*, 5,000 bytes"):
        checkpointing.start_run(tmp_path / "fresh", resume=True, estimated_bytes=123456, log=print)
    monkeypatch.undo()
    existing = _save(tmp_path / "used", 1, model, cfg)
    size = checkpointing.checkpoint_bytes(existing)
    monkeypatch.setattr(checkpointing.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - size + 1, size - 1))
    # the newest checkpoint's size
    with pytest.raises(checkpointing.CheckpointError, match=rf"needs about {size:,} bytes"):
        checkpointing.start_run(tmp_path / "used", resume=True, estimated_bytes=1, log=print)


def test_estimated_checkpoint_bytes_formula():
    assert checkpointing.estimated_checkpoint_bytes(1000, torch.float32) == 12_000
    assert checkpointing.estimated_checkpoint_bytes(1000, torch.bfloat16) == 14_000


# ----------------------------------------------------------------------------- disk faults at save
def test_disk_full_errors_are_recognised_also_when_wrapped():
    from torch.distributed.checkpoint.api import CheckpointException

    assert checkpointing.is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert checkpointing.is_disk_full(RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . "
                                                   "unexpected pos 704 vs 598"))
    wrapped = CheckpointException("save failed", {1: (OSError(errno.ENOSPC, "full"), None)})
    assert checkpointing.is_disk_full(wrapped)
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as inner:
            raise RuntimeError("writer died") from inner
    except RuntimeError as outer:
        assert checkpointing.is_disk_full(outer)
    assert not checkpointing.is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not checkpointing.is_disk_full(ValueError("bad"))


@pytest.mark.parametrize("where", ["writer", "meta"])
def test_disk_full_during_a_save_is_one_line_and_leaves_no_partial_directory(tmp_path, monkeypatch, where):
    from megatron.core import dist_checkpointing

    cfg, model = _model(0)
    if where == "writer":  # what megatron's worker processes raise when a write comes up short
        def failing_save(state, directory):
            (Path(directory) / "__0_0.distcp").write_bytes(b"partial")
            raise RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        monkeypatch.setattr(dist_checkpointing, "save", failing_save)
    else:
        real_write_text = Path.write_text

        def failing_write_text(path, text, *args, **kwargs):
            if path.name == checkpointing.META_FILE:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real_write_text(path, text, *args, **kwargs)
        monkeypatch.setattr(Path, "write_text", failing_write_text)
    with pytest.raises(checkpointing.CheckpointError) as raised:
        _save(tmp_path, 3, model, cfg)
    message = str(raised.value)
    assert message.startswith(f"disk full while saving {tmp_path / 'step_00000003'}: needs about ")
    assert " free on /" in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_before_writing_when_the_disk_is_already_too_full(tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    cfg, model = _model(0)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpointing.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    monkeypatch.setattr(dist_checkpointing, "save", lambda *args: pytest.fail("wrote on a full disk"))
    with pytest.raises(checkpointing.CheckpointError, match=r"disk full while saving .*: needs about [\d,]+ bytes .*"
                                                            r", 1,000 bytes \(0.0 MiB\) free on /"):
        _save(tmp_path, 3, model, cfg)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("manifest", ["{not json", '{"checksum": "md5", "files": {}}', '{"files": []}', "[]"])
def test_an_unreadable_manifest_is_reported_as_damage(tmp_path, manifest):
    cfg, model = _model(0)
    checkpoint = _save(tmp_path, 1, model, cfg)
    (checkpoint / checkpointing.MANIFEST_FILE).write_text(manifest)
    assert checkpointing.verify(checkpoint).startswith(
        f"{checkpoint} is damaged: its aligner_manifest.json is unreadable (")
