"""Where `python -m aligner.hf import|export` write, and what a failed write leaves.

Guarantees tested here: a non-empty output that is not the same command's earlier result (unrelated
files, a trained step, an HF model) is refused and left as it was, unless --overwrite; an output that is,
holds or lies inside an input is refused even with --overwrite; an earlier result is replaced; a
read-only or full output is one line naming the output, with nothing partial left (no output, no
staging directory).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from aligner import checkpointing  # noqa: E402
from aligner.config import ConfigError, OutputError  # noqa: E402
from aligner.hf import export_hf, import_gguf, import_hf  # noqa: E402
from aligner.hf.convert import EXPORT_RECORD_FILE, HF_SOURCE_FILE  # noqa: E402

from ..chat_tokenizers import build_chat_tokenizer  # noqa: E402
from ..unit.test_hf_gguf import run_cli_cases  # noqa: E402
from ..unit.test_hf_layout import hf_config  # noqa: E402
from .conftest import tmpfs  # noqa: E402


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under `root` (relative path) -> sha256 of its bytes."""
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file()}


def leftovers(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir() if path.name.endswith((".incomplete", ".replaced")))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny HF Llama with a tokenizer, its import (`ckpt`) and the export of that (`export`)."""
    import torch

    root = tmp_path_factory.mktemp("hf_outputs")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_config("llama")).save_pretrained(root / "hf")
    build_chat_tokenizer(root / "hf", "plain")
    import_hf(root / "hf", root / "ckpt")
    export_hf(root / "ckpt", root / "export")
    return root


def _unrelated_outputs(root: Path) -> list[Path]:
    """Non-empty directories no import or export wrote: a user's files, a trained step (a checkpoint without
    hf_source.json), an HF model."""
    notes = root / "notes"
    notes.mkdir(exist_ok=True)
    (notes / "results.txt").write_text("three weeks of evaluation\n")
    step = root / "step_00000040"
    if not step.exists():
        shutil.copytree(root / "ckpt", step)
        (step / HF_SOURCE_FILE).unlink()
    return [notes, step, root / "hf"]


def test_a_non_empty_output_that_is_not_the_commands_own_result_is_refused_and_untouched(converted):
    root = converted
    for output in _unrelated_outputs(root):
        before = tree_digest(output)
        if output != root / "hf":
            with pytest.raises(OutputError, match=f"output directory {output} is not empty and is not an earlier "
                                                  f"result of this command \\(it has no {HF_SOURCE_FILE}\\)"):
                import_hf(root / "hf", output)
        with pytest.raises(OutputError, match=f"it has no {EXPORT_RECORD_FILE}.*--overwrite"):
            export_hf(root / "ckpt", output)
        assert tree_digest(output) == before
    assert leftovers(root) == []


def test_an_output_that_is_holds_or_lies_in_an_input_is_refused_even_with_overwrite(converted):
    root = converted
    hf, ckpt = tree_digest(root / "hf"), tree_digest(root / "ckpt")
    gguf_dir = root / "gguf"
    gguf_dir.mkdir(exist_ok=True)
    (gguf_dir / "model.gguf").write_bytes(b"GGUF")
    cases = [
        (lambda: import_hf(root / "hf", root / "hf", overwrite=True), f"output {root / 'hf'} is the input"),
        (lambda: import_hf(root / "hf", root / "hf" / "ckpt", overwrite=True), "lies inside the input"),
        (lambda: import_gguf(gguf_dir / "model.gguf", gguf_dir, overwrite=True), "contains the input"),
        (lambda: export_hf(root / "ckpt", root / "ckpt", overwrite=True), f"output {root / 'ckpt'} is the input"),
        (lambda: export_hf(root / "ckpt", root, overwrite=True), f"output {root} contains the input"),
    ]
    for convert, expected in cases:
        with pytest.raises(ConfigError, match=expected):
            convert()
    assert (tree_digest(root / "hf"), tree_digest(root / "ckpt")) == (hf, ckpt)
    assert (gguf_dir / "model.gguf").read_bytes() == b"GGUF"
    assert leftovers(root) == [] and leftovers(root / "hf") == []


def test_an_earlier_result_is_replaced_and_overwrite_replaces_an_unrelated_directory(converted):
    from safetensors.torch import load_file

    root = converted
    first_export = load_file(str(root / "export" / "model.safetensors"))
    import_hf(root / "hf", root / "ckpt")  # its own earlier result: replaced
    assert checkpointing.verify(root / "ckpt") is None and (root / "ckpt" / HF_SOURCE_FILE).is_file()
    export_hf(root / "ckpt", root / "export")
    again = load_file(str(root / "export" / "model.safetensors"))
    assert again.keys() == first_export.keys() and all(again[k].equal(first_export[k]) for k in again)
    replaced = root / "replaced"
    replaced.mkdir()
    (replaced / "old.txt").write_text("replace me")
    import_hf(root / "hf", replaced, overwrite=True)
    assert not (replaced / "old.txt").exists() and checkpointing.verify(replaced) is None
    assert leftovers(root) == []


def test_a_full_disk_during_export_is_one_line_and_leaves_nothing(converted, monkeypatch):
    """The failure the issue saw: model.safetensors written, then the disk fills while the tokenizer is
    copied. Unprivileged: the copy raises the kernel's ENOSPC."""
    root = converted
    copy = shutil.copy2

    def copy_on_a_full_disk(source, target, **kwargs):
        if Path(source).name == "tokenizer.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        return copy(source, target, **kwargs)

    monkeypatch.setattr(shutil, "copy2", copy_on_a_full_disk)
    output = root / "full"
    with pytest.raises(OutputError) as failure:
        export_hf(root / "ckpt", output)
    assert str(failure.value) == f"cannot write {output}: disk full (no space left on the device); nothing was written"
    assert not output.exists() and leftovers(root) == []


# ----------------------------------------------------------------------------- real read-only and full disks
def _footprint(paths) -> int:
    """Bytes the files take on a tmpfs (whole 4 KiB pages)."""
    return sum(-(-path.stat().st_size // 4096) * 4096 for path in paths)


def test_read_only_and_full_outputs_are_one_line_through_the_cli_and_leave_nothing(converted, tmp_path):
    root = converted
    read_only, full_export, full_import = tmp_path / "read_only", tmp_path / "full_export", tmp_path / "full_import"
    export_files = [path for path in (root / "export").iterdir()]
    weights = root / "export" / "model.safetensors"
    # Room for config.json and model.safetensors, not for the tokenizer files after them (the case).
    export_size = _footprint([weights, root / "export" / "config.json"]) + 4096
    assert export_size < _footprint(export_files)
    # Room for the tensor data (the save's check of the free space passes), not for the whole checkpoint:
    # the disk fills up in the middle of the writes.
    import_size = _footprint((root / "ckpt").rglob("*.distcp")) + 4096
    assert import_size < _footprint(path for path in (root / "ckpt").rglob("*") if path.is_file())
    mounts = [(read_only, "ro,size=1m"), (full_export, f"size={export_size}"), (full_import, f"size={import_size}")]
    with contextlib.ExitStack() as mounted:
        for mount, options in mounts:
            mounted.enter_context(tmpfs(mount, options))
        cases = [
            (["import", "--hf-dir", str(root / "hf"), "--output", str(read_only / "ckpt")],
             f"error: cannot write {read_only / 'ckpt'}: Read-only file system; nothing was written"),
            (["export", "--checkpoint", str(root / "ckpt"), "--output", str(read_only / "export")],
             f"error: cannot write {read_only / 'export'}: Read-only file system; nothing was written"),
            (["export", "--checkpoint", str(root / "ckpt"), "--output", str(full_export / "export")],
             f"error: cannot write {full_export / 'export'}: disk full"),
            (["import", "--hf-dir", str(root / "hf"), "--output", str(full_import / "ckpt")],
             f"error: disk full while saving {full_import / 'ckpt'}: needs about "),
        ]
        outcomes = run_cli_cases([args for args, _ in cases])
        for (args, expected), (status, stderr) in zip(cases, outcomes):
            lines = stderr.strip().splitlines()
            assert status == 2 and len(lines) == 1 and lines[0].startswith(expected), (args, status, stderr[-3000:])
            assert lines[0].endswith("nothing was written"), lines[0]
        for mount, _ in mounts:
            assert list(mount.iterdir()) == [], mount  # no output, no staging directory

