"""Checkpoint faults through the real SFT entry point: kill -9 (also mid-save) then resume, damaged
shards, flipped bytes, a full or read-only save_dir, resume=false into a used save_dir, a second run on a
live run's save_dir, a resume with another architecture.

Every run is a tiny SFT model (2 layers, 32 wide) on the demo's arithmetic task; a reference run
without faults gives the losses a faulted-and-resumed run must reproduce bit for bit.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aligner import checkpointing
from aligner.demo import arithmetic
from aligner.demo.tokenizer import train_char_tokenizer
from aligner.runtime import run_lock

from ..conftest import REPO_ROOT, write_jsonl
from .conftest import tmpfs

SFT_SCRIPT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_sft.py"
MAX_STEPS, SAVE_INTERVAL = 12, 3


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt_faults")
    records = arithmetic.sft_records(128, seed=0)
    write_jsonl(root / "sft.jsonl", records)
    train_char_tokenizer([r["input"] + r["output"] for r in records], root / "tokenizer")
    return root


def sft_command(data: Path, run_dir: Path, *overrides: str, save_dir: Path | None = None) -> list[str]:
    return [
        sys.executable, str(SFT_SCRIPT), f"tokenizer.path={data / 'tokenizer'}",
        f"data.train=[{{path: {data / 'sft.jsonl'}}}]",
        "data.split='100,0'", "data.max_seq_length=16", "model.architecture.num_layers=2",
        "model.architecture.hidden_size=32", "model.architecture.num_attention_heads=4",
        "model.architecture.num_query_groups=2", "model.architecture.ffn_hidden_size=64",
        f"trainer.max_steps={MAX_STEPS}", "trainer.global_batch_size=8", "trainer.micro_batch_size=8",
        "trainer.val_check_interval=0", "optim.lr=3e-3", "optim.warmup_steps=2", "logging.progress_bar=false",
        "logging.tensorboard=false", "logging.peak_tflops=1.0", f"checkpoint.save_interval={SAVE_INTERVAL}",
        "checkpoint.keep_last=2", f"checkpoint.save_dir={save_dir or run_dir / 'ckpt'}", f"logging.log_dir={run_dir}",
        *overrides,
    ]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
            "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def run_sft(data: Path, run_dir: Path, *overrides: str, save_dir: Path | None = None,
            wrapper: Path | None = None) -> subprocess.CompletedProcess:
    command = sft_command(data, run_dir, *overrides, save_dir=save_dir)
    if wrapper is not None:
        command.insert(1, str(wrapper))
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300, env=_env())


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every train row in metrics.jsonl, re-run steps included; a line cut by a kill is skipped."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("split") == "train":
            rows.append((row["step"], row["loss"]))
    return rows


def tree_digest(directory: Path) -> dict[str, str]:
    return {path.relative_to(directory).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error: ")]


@pytest.fixture(scope="module")
def reference(sft_data, tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """An uninterrupted run: its directory (checkpoints at steps 9 and 12 kept) and its loss per step."""
    run_dir = tmp_path_factory.mktemp("reference")
    result = run_sft(sft_data, run_dir)
    assert result.returncode == 0, result.stderr[-4000:]
    losses = dict(train_losses(run_dir))
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    assert [step for step, _ in checkpointing.step_checkpoints(run_dir / "ckpt")] == [9, 12]
    return run_dir, losses


def _copy_checkpoints(reference_dir: Path, run_dir: Path) -> Path:
    shutil.copytree(reference_dir / "ckpt", run_dir / "ckpt")
    return run_dir / "ckpt"


def _largest_shard(checkpoint: Path) -> Path:
    return max(checkpoint.glob("*.distcp"), key=lambda path: path.stat().st_size)


# ----------------------------------------------------------------------------- kill -9, then resume
def _start(data: Path, run_dir: Path) -> subprocess.Popen:
    # Its own process group: the kill takes the trainer and megatron's writer processes together.
    return subprocess.Popen(sft_command(data, run_dir), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=REPO_ROOT, env=_env(), start_new_session=True)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=60)


def _wait_for(condition, process: subprocess.Popen, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if process.poll() is not None:
            return False
        time.sleep(0.002)
    raise AssertionError("the run neither reached the kill point nor ended")


@pytest.mark.slow
def test_kill_9_at_random_points_and_mid_save_then_resume_gives_identical_losses(sft_data, reference, tmp_path):
    _, expected = reference
    mid_save_kills = 0
    for seed in (0, 1, 2):
        rng = random.Random(seed)
        run_dir = tmp_path / f"seed{seed}"
        save_dir = run_dir / "ckpt"
        # Kill 1: while a randomly chosen save is being written; kill 2: after a random training step.
        save_step = rng.choice([SAVE_INTERVAL * k for k in range(1, MAX_STEPS // SAVE_INTERVAL)])
        staging = checkpointing.step_dir(save_dir, save_step).with_name(f"step_{save_step:08d}.incomplete")
        process = _start(sft_data, run_dir)
        try:
            if _wait_for(staging.exists, process):
                time.sleep(rng.uniform(0.0, 0.05))
                _kill_group(process)
                mid_save_kills += staging.exists()
                print(f"seed {seed}: killed while saving step {save_step}: partial save left: {staging.exists()}")
        finally:
            _kill_group(process)
        rows_before = len(train_losses(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0
        steps_before_kill = rng.randint(0, 4)  # 0: during start-up or the resume load
        process = _start(sft_data, run_dir)
        try:
            rows_wanted = rows_before + steps_before_kill
            _wait_for(lambda: (run_dir / "metrics.jsonl").exists()  # noqa: B023 - called in this iteration only
                      and len(train_losses(run_dir)) >= rows_wanted, process)  # noqa: B023
            time.sleep(rng.uniform(0.0, 0.2))
        finally:
            _kill_group(process)
        print(f"seed {seed}: killed {steps_before_kill} step(s) after the resume")
        result = run_sft(sft_data, run_dir)
        assert result.returncode == 0, result.stderr[-4000:]
        rows = train_losses(run_dir)
        assert {step for step, _ in rows} == set(expected), f"seed {seed}: steps {sorted({s for s, _ in rows})}"
        for step, loss in rows:  # every run of every step, before and after each resume: bit-identical
            assert loss == expected[step], f"seed {seed} step {step}: {loss!r} != {expected[step]!r}"
        assert not list(save_dir.glob("*.incomplete")), f"seed {seed}: partial saves left behind"
        assert [step for step, _ in checkpointing.step_checkpoints(save_dir)] == [9, 12]
        assert checkpointing.verify(save_dir / "step_00000012") is None
    assert mid_save_kills >= 1, "no kill landed inside a save"


# ----------------------------------------------------------------------------- damage
@pytest.mark.parametrize("damage, cause", [
    ("truncate", r"__0_\d\.distcp is truncated to 1000 of \d+ bytes"),
    ("delete", r"__0_\d\.distcp is missing"),
    ("flip", r"__0_\d\.distcp fails its sha256 check \(its bytes changed after the save\)"),
])
def test_a_damaged_newest_checkpoint_is_reported_and_resume_falls_back(sft_data, reference, tmp_path, damage, cause):
    reference_dir, expected = reference
    save_dir = _copy_checkpoints(reference_dir, tmp_path)
    shard = _largest_shard(save_dir / "step_00000012")
    if damage == "truncate":
        os.truncate(shard, 1000)
    elif damage == "delete":
        shard.unlink()
    else:  # bytes inside the tensor data flipped, the size unchanged
        data = bytearray(shard.read_bytes())
        for offset in range(len(data) // 2, len(data) // 2 + 16):
            data[offset] ^= 0x5A
        shard.write_bytes(bytes(data))
    result = run_sft(sft_data, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    warnings = [line for line in result.stdout.splitlines() if "is damaged" in line]
    assert len(warnings) == 1, result.stdout[-3000:]
    assert re.search(rf"warning: {save_dir / 'step_00000012'} is damaged: {cause}; not resuming from it", warnings[0])
    assert f"resuming from {save_dir / 'step_00000009'} instead" in result.stdout
    assert f"resumed from {save_dir / 'step_00000009'} at step 9" in result.stdout
    assert dict(train_losses(tmp_path)) == {step: expected[step] for step in (10, 11, 12)}
    assert checkpointing.verify(save_dir / "step_00000012") is None  # re-saved whole


def test_a_damaged_init_from_checkpoint_is_one_line_naming_the_file(sft_data, reference, tmp_path):
    reference_dir, _ = reference
    save_dir = _copy_checkpoints(reference_dir, tmp_path / "source")
    shard = _largest_shard(save_dir / "step_00000012")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    result = run_sft(sft_data, tmp_path / "run", f"model.init_from={save_dir / 'step_00000012'}")
    assert result.returncode == 2, result.stderr[-4000:]
    assert error_lines(result) == [f"error: {save_dir / 'step_00000012'} is damaged: {shard.name} fails its sha256 "
                                   "check (its bytes changed after the save)"]
    assert "Traceback" not in result.stderr


# ----------------------------------------------------------------------------- run ownership
def test_resume_false_into_a_used_save_dir_is_refused_and_nothing_is_deleted(sft_data, reference, tmp_path):
    reference_dir, _ = reference
    save_dir = _copy_checkpoints(reference_dir, tmp_path)
    before = tree_digest(save_dir)
    result = run_sft(sft_data, tmp_path, "checkpoint.resume=false", "checkpoint.keep_last=1")
    assert result.returncode == 2
    assert error_lines(result) == [
        f"error: checkpoint.save_dir={save_dir} already holds 2 checkpoint(s) of an earlier run (step_00000009 to "
        "step_00000012) and checkpoint.resume=false would mix this run with them: set checkpoint.resume=true to "
        "continue that run, choose another checkpoint.save_dir, or delete those step_* directories to start over"]
    assert "parameters, layout" not in result.stdout  # refused before the model was built
    assert tree_digest(save_dir) == before


def _same_checkpoint_but_ids(first: Path, second: Path) -> bool:
    """Bit-identical files, but for what names the save itself: the run id in the meta (and so the manifest) and
    the path and save id in torch's `.metadata` (whose tensor layout and storage records must be equal)."""
    from torch.distributed.checkpoint import FileSystemReader

    own = {checkpointing.META_FILE, checkpointing.MANIFEST_FILE, ".metadata"}
    metas = [checkpointing.read_meta(path) for path in (first, second)]
    layouts = [FileSystemReader(str(path)).read_metadata() for path in (first, second)]
    return ({name: digest for name, digest in tree_digest(first).items() if name not in own}
            == {name: digest for name, digest in tree_digest(second).items() if name not in own}
            and {**metas[0], "run_id": None} == {**metas[1], "run_id": None}
            and all(getattr(layouts[0], part) == getattr(layouts[1], part)
                    for part in ("state_dict_metadata", "planner_data", "storage_data")))


def test_a_second_run_on_a_live_runs_save_dir_is_refused_and_the_first_run_is_untouched(sft_data, reference,
                                                                                         tmp_path):
    """Run A trains (frozen by SIGSTOP once its model is built); run B on the same save_dir is refused in one
    line naming A, before building a model; A then finishes exactly as a solo run."""
    reference_dir, expected = reference
    save_dir = tmp_path / "ckpt"
    with open(tmp_path / "a.stdout", "w") as a_stdout, open(tmp_path / "a.stderr", "w") as a_stderr:
        first = subprocess.Popen(sft_command(sft_data, tmp_path), stdout=a_stdout, stderr=a_stderr, cwd=REPO_ROOT,
                                 env={**_env(), "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        built = _wait_for(lambda: "parameters, layout" in (tmp_path / "a.stdout").read_text(), first)
        assert built, (tmp_path / "a.stderr").read_text()[-3000:]
        os.kill(first.pid, signal.SIGSTOP)
        in_progress = save_dir / "step_00000099.incomplete"  # stands for a save A is writing: B must not sweep it
        in_progress.mkdir(parents=True)
        try:
            second = run_sft(sft_data, tmp_path / "b", save_dir=save_dir)
            holder = run_lock.read_holder(save_dir)
        finally:
            os.kill(first.pid, signal.SIGCONT)
        assert second.returncode == 2, second.stderr[-4000:]
        assert holder is not None and holder.pid == first.pid
        assert in_progress.is_dir()
        assert error_lines(second) == [
            f"error: checkpoint.save_dir={save_dir} is in use by run {holder.run_id} (pid {first.pid} on "
            f"{holder.host}, since {holder.since}): one run per save_dir; wait for that run to end (or stop it), set "
            "checkpoint.lock_wait_s to wait for it, or choose another checkpoint.save_dir"]
        assert "Traceback" not in second.stderr
        assert "parameters, layout" not in second.stdout  # refused before the model was built
        assert first.wait(timeout=120) == 0, (tmp_path / "a.stderr").read_text()[-3000:]
    finally:
        _kill_group(first)
    assert dict(train_losses(tmp_path)) == expected
    assert [step for step, _ in checkpointing.step_checkpoints(save_dir)] == [9, 12]
    for step in (9, 12):
        ours, solo = checkpointing.step_dir(save_dir, step), checkpointing.step_dir(reference_dir / "ckpt", step)
        assert _same_checkpoint_but_ids(ours, solo)
        assert checkpointing.verify(ours) is None
        assert checkpointing.read_meta(ours)["run_id"] == holder.run_id
    assert (save_dir / run_lock.LOCK_FILE).read_text() == ""  # released at the end


def test_resuming_with_another_architecture_is_one_line_naming_what_differs(sft_data, reference, tmp_path):
    reference_dir, _ = reference
    save_dir = _copy_checkpoints(reference_dir, tmp_path)
    result = run_sft(sft_data, tmp_path, "model.architecture.hidden_size=64")
    assert result.returncode == 2, result.stderr[-4000:]
    assert error_lines(result) == [
        f"error: {save_dir / 'step_00000012'} holds a model of another architecture than this run's (hidden_size: 32 "
        "in the checkpoint, 64 here): give this run the settings the checkpoint was saved with, or another checkpoint"]
    assert "Traceback" not in result.stderr


# ----------------------------------------------------------------------------- full and read-only disks
def _tensor_bytes(checkpoint: Path) -> int:
    """Bytes of tensor data in a checkpoint, from torch's own metadata (what a save of it must write)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    return sum(math.prod(entry.size) * entry.properties.dtype.itemsize
               for entry in metadata.state_dict_metadata.values() if isinstance(entry, TensorStorageMetadata))


def _assert_disk_full_reported(result: subprocess.CompletedProcess, save_dir: Path, mount: Path) -> None:
    assert result.returncode == 2, result.stderr[-4000:]
    lines = error_lines(result)
    assert len(lines) == 1, result.stderr[-4000:]
    assert lines[0].startswith(f"error: disk full while saving {save_dir / 'step_00000003'}: needs about "), lines[0]
    assert lines[0].endswith(f" free on {mount}"), lines[0]
    assert [line for line in result.stderr.splitlines() if line.strip()] == lines  # nothing else, no traceback
    assert not list(save_dir.glob("*.incomplete"))


def test_a_full_tmpfs_during_a_save_is_one_line_and_leaves_no_partial_directory(sft_data, reference, tmp_path):
    reference_dir, _ = reference
    checkpoint = reference_dir / "ckpt" / "step_00000012"
    tensor_bytes = _tensor_bytes(checkpoint)
    footprint = sum(-(-path.stat().st_size // 4096) * 4096 for path in checkpoint.rglob("*") if path.is_file())
    # Room for the tensor data (the start-up and pre-save checks pass) but not for the whole checkpoint:
    # the disk fills up in the middle of megatron's writes.
    size = (tensor_bytes + footprint) // 2 // 4096 * 4096
    assert tensor_bytes < size < footprint
    mount = tmp_path / "small_disk"
    with tmpfs(mount, f"size={size}"):
        result = run_sft(sft_data, tmp_path, save_dir=mount / "ckpt")
        _assert_disk_full_reported(result, mount / "ckpt", mount)
        assert sorted(dict(train_losses(tmp_path))) == [1, 2, 3]  # trained up to the first save


_FULL_DISK_WRAPPER = '''
import builtins, io, runpy, sys

real_open = io.open


def open_on_full_disk(file, mode="r", *args, **kwargs):
    """Files written inside a staging directory go to /dev/full: every write fails with ENOSPC."""
    if any(flag in mode for flag in "wax") and ".incomplete" in str(file):
        return real_open("/dev/full", mode.replace("x", "w"), *args, **kwargs)
    return real_open(file, mode, *args, **kwargs)


builtins.open = io.open = open_on_full_disk
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def test_enospc_from_the_kernel_inside_megatrons_writers_is_one_line(sft_data, tmp_path):
    """Unprivileged: the real save path's file writes go to /dev/full, which fails them with ENOSPC."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    wrapper = tmp_path / "full_disk.py"
    wrapper.write_text(_FULL_DISK_WRAPPER)
    save_dir = tmp_path / "ckpt"
    result = run_sft(sft_data, tmp_path, wrapper=wrapper)
    mount = Path(os.path.abspath(save_dir))
    while not os.path.ismount(mount):
        mount = mount.parent
    _assert_disk_full_reported(result, save_dir, mount)


@pytest.mark.parametrize("kind", ["read_only_mount", "under_a_file"])
def test_an_unwritable_save_dir_is_refused_at_start_up(sft_data, tmp_path, kind):
    if kind == "read_only_mount":  # chmod does not stop root; a read-only mount does
        with tmpfs(tmp_path / "read_only", "ro,size=1m") as save_dir:
            result = run_sft(sft_data, tmp_path / "logs", save_dir=save_dir)
    else:
        (tmp_path / "a_file").write_text("")
        save_dir = tmp_path / "a_file" / "ckpt"
        result = run_sft(sft_data, tmp_path / "logs", save_dir=save_dir)
    assert result.returncode == 2, result.stderr[-4000:]
    lines = error_lines(result)
    reason = "Read-only file system" if kind == "read_only_mount" else "Not a directory"
    assert len(lines) == 1 and lines[0].startswith(f"error: checkpoint.save_dir={save_dir} is not writable ("), lines
    assert reason in lines[0]
    assert "parameters, layout" not in result.stdout  # before the model was built, long before training
    assert not (tmp_path / "logs" / "metrics.jsonl").exists() or not train_losses(tmp_path / "logs")


# ----------------------------------------------------------------------------- two ranks
@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_split_the_checksums_and_agree_on_the_fallback(sft_data, tmp_path):
    """At DP=2 each rank hashes a share of the files; the manifest still matches every file, and a
    damaged newest checkpoint is reported once and skipped by both ranks."""
    from ..conftest import run_torchrun

    args = [*sft_command(sft_data, tmp_path)[2:], "trainer.micro_batch_size=4"]
    run_torchrun(SFT_SCRIPT, 2, *args, timeout=300)
    expected = dict(train_losses(tmp_path))
    save_dir = tmp_path / "ckpt"
    assert [step for step, _ in checkpointing.step_checkpoints(save_dir)] == [9, 12]
    for _, checkpoint in checkpointing.step_checkpoints(save_dir):
        manifest = json.loads((checkpoint / checkpointing.MANIFEST_FILE).read_text())["files"]
        digests = tree_digest(checkpoint)
        assert set(manifest) == set(digests) - {checkpointing.MANIFEST_FILE}
        assert all(entry["sha256"] == digests[name] for name, entry in manifest.items())
    shard = _largest_shard(save_dir / "step_00000012")
    os.truncate(shard, 1000)
    output = run_torchrun(SFT_SCRIPT, 2, *args, timeout=300)
    warnings = [line for line in output.splitlines() if "is damaged" in line]
    assert len(warnings) == 1 and f"{shard.name} is truncated to 1000 of" in warnings[0], output[-3000:]
    assert f"resuming from {save_dir / 'step_00000009'} instead" in output
    resumed = train_losses(tmp_path)[len(expected):]
    assert resumed == [(step, expected[step]) for step in (10, 11, 12)]


def test_rerunning_a_finished_run_resumes_at_its_end_and_saves_nothing(sft_data, reference, tmp_path):
    reference_dir, _ = reference
    save_dir = _copy_checkpoints(reference_dir, tmp_path)
    before = tree_digest(save_dir)
    result = run_sft(sft_data, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"resumed from {save_dir / 'step_00000012'} at step 12" in result.stdout
    assert "saved checkpoint" not in result.stdout
    assert tree_digest(save_dir) == before
