"""An HF directory as `model.init_from` of a TP=2 SFT run under torchrun: both ranks take part in the import
(at TP=1 x DP=2, rank 0 holding the cache's lock), then train at TP=2 from it; the first loss is a
one-process run's from the same directory."""
from __future__ import annotations

import shutil

import pytest

from aligner.hf.sources import IMPORTS_DIR, source_digest

from ..conftest import REPO_ROOT, metrics_rows, run_torchrun
from ..unit.test_model_sources import _sft, sft_overrides, write_hf_model

pytestmark = pytest.mark.distributed


def test_a_tp2_run_imports_an_hf_dir_once_and_trains_from_it(tmp_path, arithmetic_tokenizer_dir, monkeypatch):
    monkeypatch.setenv("ALIGNER_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = write_hf_model(tmp_path / "hf", arithmetic_tokenizer_dir, seed=4)
    _sft(tmp_path, hf_dir, "one_process")
    target = tmp_path / "cache" / IMPORTS_DIR / source_digest(hf_dir, "hf")
    shutil.rmtree(target)  # the TP=2 run imports it again, with both ranks
    out = run_torchrun(REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_sft.py", 2,
                       *sft_overrides(tmp_path, hf_dir, "tp2"), "parallel.tensor_model_parallel_size=2")
    assert out.count(f"model.init_from={hf_dir}: imported into the cache at {target} ") == 1, out[-3000:]
    assert (target / "hf_source.json").is_file()
    [tp2], [one] = metrics_rows(tmp_path / "tp2", "train"), metrics_rows(tmp_path / "one_process", "train")
    assert tp2["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-6)
