"""Any model source as a start (aligner.hf.sources): an aligner checkpoint, a run directory (its latest intact
checkpoint), an HF model directory or a GGUF file (imported once into the cache, keyed by the source's bytes).

The references: transformers' logits of the same HF model / GGUF file, and `python -m aligner.hf import`'s
checkpoint of the same source (the cached import must equal it exactly).
"""
from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from aligner import checkpointing  # noqa: E402
from aligner.algorithms.dpo import DPOConfig, build_dpo_trainer  # noqa: E402
from aligner.algorithms.sft import SFTConfig, build_sft_trainer  # noqa: E402
from aligner.config import CONF_DIR, load_config  # noqa: E402
from aligner.demo import arithmetic  # noqa: E402
from aligner.hf.sources import IMPORTS_DIR, resolve_model_source, source_digest  # noqa: E402
from aligner.runtime.errors import ConfigError  # noqa: E402

from ..conftest import metrics_rows, write_jsonl  # noqa: E402
from ..gguf_files import aligner_logits, transformers_reference, write_tiny_llama_gguf  # noqa: E402
from .test_hf_layout import hf_config  # noqa: E402

TOKENS = torch.tensor([[1, 5, 9, 13, 4, 7, 2, 11]])


def write_hf_model(directory: Path, tokenizer_dir: Path, seed: int) -> Path:
    """A tiny random Llama saved by transformers, with the arithmetic tokenizer's files beside it."""
    model = transformers.LlamaForCausalLM(hf_config("llama"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
    for file in tokenizer_dir.iterdir():
        shutil.copy2(file, directory / file.name)
    return directory


def _hf_logits(hf_dir: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        return model(TOKENS).logits.float()


def sft_overrides(tmp_path: Path, init_from: Path, name: str) -> list[str]:
    """train_gpt_sft.py's settings for one step from `init_from` on arithmetic records (log and save dir: name)."""
    train = write_jsonl(tmp_path / "sft.jsonl", arithmetic.sft_records(16, seed=3))
    return [f"model.init_from={init_from}", f"data.train=[{{path: {train}}}]", "data.split='100,0'",
            "data.max_seq_length=32", "trainer.max_steps=1", "trainer.global_batch_size=4",
            "trainer.micro_batch_size=2", "trainer.val_check_interval=0", "optim.lr=1e-3", "optim.min_lr=0",
            "checkpoint.save_at_end=false", f"checkpoint.save_dir={tmp_path / name}",
            f"logging.log_dir={tmp_path / name}", "logging.progress_bar=false", "logging.tensorboard=false",
            "logging.peak_tflops=1.0"]


def _sft(tmp_path: Path, init_from: Path, name: str, *extra: str):
    """One SFT step from `init_from` (`sft_overrides`), in this process."""
    cfg = load_config(SFTConfig, CONF_DIR / "gpt_sft.yaml", [*sft_overrides(tmp_path, init_from, name), *extra])
    trainer = build_sft_trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.metrics.close()


@pytest.fixture
def log_lines() -> list[str]:
    """The lines logged by aligner's loggers during the test."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Collect(logging.INFO)
    logger = logging.getLogger("aligner")
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, arithmetic_tokenizer_dir) -> Path:
    return write_hf_model(tmp_path_factory.mktemp("sources") / "hf", arithmetic_tokenizer_dir, seed=0)


def test_sft_starts_from_an_hf_dir_imported_once_and_again_when_its_bytes_change(tmp_path, hf_dir, import_cache,
                                                                                  log_lines, arithmetic_tokenizer_dir):
    from aligner.hf.__main__ import main as hf_cli

    digest = source_digest(hf_dir, "hf")
    cached = import_cache / IMPORTS_DIR / digest
    shutil.rmtree(cached, ignore_errors=True)  # this test's first start imports
    _sft(tmp_path, hf_dir, "first")
    assert f"model.init_from={hf_dir}: imported into the cache at {cached} (sha256 {digest[:16]})" in log_lines
    assert len(metrics_rows(tmp_path / "first", "train")) == 1

    # The cached import is `python -m aligner.hf import`'s checkpoint: the same logits, bit for bit,
    # and transformers' logits of the HF model (the independent reference).
    hf_cli(["import", "--hf-dir", str(hf_dir), "--output", str(tmp_path / "direct")])
    logits = aligner_logits(cached, TOKENS)
    assert torch.equal(logits, aligner_logits(tmp_path / "direct", TOKENS))
    assert (logits[..., :100] - _hf_logits(hf_dir)).abs().max().item() < 1e-4
    log_lines.clear()

    # A second start from the same bytes: no import (the cached files are the first start's).
    meta_written = (cached / checkpointing.META_FILE).stat().st_mtime_ns
    _sft(tmp_path, hf_dir, "second")
    assert (f"model.init_from={hf_dir}: its import cached at {cached} (sha256 {digest[:16]}, the same bytes)"
            in log_lines)
    assert not any("imported into the cache" in line for line in log_lines)
    assert (cached / checkpointing.META_FILE).stat().st_mtime_ns == meta_written

    # Other weights in the same directory (same names, same sizes): another key, imported again.
    changed = write_hf_model(tmp_path / "changed", arithmetic_tokenizer_dir, seed=1)
    changed_digest = source_digest(changed, "hf")
    assert changed_digest != digest
    _sft(tmp_path, changed, "third")
    assert (f"model.init_from={changed}: imported into the cache at {import_cache / IMPORTS_DIR / changed_digest} "
            f"(sha256 {changed_digest[:16]})" in log_lines)
    assert (aligner_logits(import_cache / IMPORTS_DIR / changed_digest, TOKENS)[..., :100]
            - _hf_logits(changed)).abs().max().item() < 1e-4


def test_sft_starts_from_a_gguf_file(tmp_path, import_cache, log_lines):
    gguf_file = write_tiny_llama_gguf(tmp_path / "tiny.gguf", seed=2)
    digest = source_digest(gguf_file, "gguf")
    cached = import_cache / IMPORTS_DIR / digest
    _sft(tmp_path, gguf_file, "gguf", "data.chat_template=false")  # its template would not fit 32 tokens
    assert f"model.init_from={gguf_file}: imported into the cache at {cached} (sha256 {digest[:16]})" in log_lines
    _, _, hf_model, _ = transformers_reference(gguf_file)
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
    logits = aligner_logits(cached, TOKENS)
    assert (logits[..., :expected.shape[-1]] - expected).abs().max().item() < 1e-4
    # the tokenizer came from the file, through the cached checkpoint
    assert (cached / checkpointing.TOKENIZER_DIR / "tokenizer.json").is_file()


def _run_dir(root: Path, checkpoint: Path) -> Path:
    """A save_dir with intact step 1 and 2, a damaged step 3 and a partial step 4 (an interrupted save)."""
    for step in (1, 2, 3):
        shutil.copytree(checkpoint, checkpointing.step_dir(root, step))
    damaged = max((path for path in checkpointing.step_dir(root, 3).rglob("*") if path.is_file()),
                  key=lambda path: path.stat().st_size)  # a weights file
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    partial = checkpointing.step_dir(root, 4).with_name("step_00000004.incomplete")
    partial.mkdir()
    return root


def test_a_run_directory_starts_from_its_latest_intact_checkpoint(tmp_path, hf_dir, log_lines):
    checkpoint = resolve_model_source(hf_dir, "model.init_from", print)  # the cached import, as a step's files
    run = _run_dir(tmp_path / "run", checkpoint)
    lines = []
    assert resolve_model_source(run, "critic.init_from", lines.append) == checkpointing.step_dir(run, 2)
    assert lines[0].startswith(f"warning: {checkpointing.step_dir(run, 3)} is damaged: ")
    assert lines[0].endswith("; not starting from it")
    assert lines[-1] == f"critic.init_from={run}: its latest intact checkpoint step_00000002"

    _sft(tmp_path, run, "from_run")
    assert f"model.init_from={run}: its latest intact checkpoint step_00000002" in log_lines


def test_the_dpo_reference_and_the_critic_start_from_an_hf_dir(tmp_path, hf_dir, log_lines):
    """Non-policy starts: DPO's reference is the resolved HF start (the first loss is log 2: policy ==
    reference); the critic's `critic.init_from` is an HF directory (a policy: a fresh value head)."""
    from aligner.algorithms.critic import CriticCheckpointConfig, CriticConfig, CriticSection, build_critic
    from aligner.runtime import distributed

    train = write_jsonl(tmp_path / "pairs.jsonl", arithmetic.preference_records(8, seed=7))
    cfg = load_config(DPOConfig, CONF_DIR / "gpt_dpo.yaml", [
        f"model.init_from={hf_dir}", f"data.train=[{{path: {train}}}]", "data.split='100,0'",
        "data.max_seq_length=32", "trainer.max_steps=1", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
        "trainer.val_check_interval=0", "optim.min_lr=0", "dpo.reference_logprobs=swap", "checkpoint.save_at_end=false",
        f"checkpoint.save_dir={tmp_path / 'dpo'}", f"logging.log_dir={tmp_path / 'dpo'}", "logging.progress_bar=false",
        "logging.tensorboard=false", "logging.peak_tflops=1.0"])
    trainer = build_dpo_trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.metrics.close()
    assert metrics_rows(tmp_path / "dpo", "train")[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)

    critic_cfg = CriticConfig(critic=CriticSection(init_from=str(hf_dir)),
                              checkpoint=CriticCheckpointConfig(save_dir=str(tmp_path / "critic")))
    try:
        critic, _ = build_critic(critic_cfg)
    finally:
        distributed.shutdown()
    cached = resolve_model_source(hf_dir, "model.init_from", print)
    assert critic_cfg.critic.init_from == str(cached) and critic.cfg.critic.init_from == str(cached)
    assert any(line.startswith(f"critic.init_from={hf_dir}: its import cached at {cached} ") for line in log_lines)


@pytest.mark.parametrize("make, message", [
    (lambda root: root / "missing", "does not exist"),
    (lambda root: (root / "weights.bin").write_bytes(b"x") and root / "weights.bin", "is a file but not a .gguf file"),
    (lambda root: (root / "run" / "step_00000001.incomplete").mkdir(parents=True) or root / "run",
     "holds no complete checkpoint (only step_00000001.incomplete"),
    (lambda root: (root / "empty").mkdir() or root / "empty", "is a directory of none of these kinds"),
])
def test_a_path_that_names_no_model_is_one_line_naming_the_key(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(ConfigError) as refused:
        resolve_model_source(path, "teacher.init_from", print)
    assert str(refused.value).startswith(f"teacher.init_from={path} {message}")
    assert "\n" not in str(refused.value)


# Two runs that start from the same HF directory at the same moment (each waits until both are ready).
_START_TOGETHER = """
import sys, time
from pathlib import Path
from aligner.hf.sources import resolve_model_source
ready, other = Path(sys.argv[2] + ".ready"), Path(sys.argv[3] + ".ready")
ready.touch()
while not other.exists():
    time.sleep(0.01)
print("RESOLVED", resolve_model_source(sys.argv[1], "model.init_from", print))
"""


def test_runs_importing_the_same_source_at_once_share_one_import(tmp_path, hf_dir, monkeypatch):
    import os
    import subprocess
    import sys

    from ..conftest import REPO_ROOT

    monkeypatch.setenv("ALIGNER_CACHE_DIR", str(tmp_path / "cache"))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen([sys.executable, "-c", _START_TOGETHER, str(hf_dir), str(tmp_path / name),
                              str(tmp_path / other)], env=env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE) for name, other in (("a", "b"), ("b", "a"))]
    outputs = [run.communicate(timeout=240) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-3000:] for _, err in outputs]
    target = tmp_path / "cache" / IMPORTS_DIR / source_digest(hf_dir, "hf")
    lines = [line for out, _ in outputs for line in out.splitlines()]
    assert [line for line in lines if line.startswith("RESOLVED")] == [f"RESOLVED {target}"] * 2
    assert sum(": imported into the cache at " in line for line in lines) == 1
    assert sum(": its import cached at " in line for line in lines) == 1
    # one whole import, nothing staged left behind
    assert sorted(path.name for path in target.parent.iterdir() if not path.name.endswith(".lock")) == [target.name]
    assert (aligner_logits(target, TOKENS)[..., :100] - _hf_logits(hf_dir)).abs().max().item() < 1e-4


def test_the_cache_key_covers_the_converters_code(tmp_path, hf_dir, monkeypatch):
    """An edited converter (a fixed mapping, a new family) imports again instead of reusing an old import."""
    import types

    from aligner.hf import convert, gguf, layout, sources, weights

    before = source_digest(hf_dir, "hf")
    edited = tmp_path / "layout.py"
    edited.write_bytes(Path(layout.__file__).read_bytes() + b"\n# edited\n")
    monkeypatch.setattr(sources, "CONVERTER_MODULES", (convert, gguf, types.SimpleNamespace(__file__=str(edited)),
                                                         weights))
    assert source_digest(hf_dir, "hf") != before
