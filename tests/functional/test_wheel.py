"""An installed wheel finds its configs: the project built with `pip wheel`, installed into a fresh venv outside
the source tree (the source tree's editable aligner not visible), runs one SFT step with the shipped gpt_sft.yaml
through the `aligner` console script (`python -m aligner`)."""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from aligner.training.metrics import read_metrics

from ..conftest import REPO_ROOT, write_jsonl


def _run(command: list, **kwargs) -> str:
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.mark.slow  # build, venv, install, one SFT step in a fresh interpreter: ~70 s on 2 busy cores
def test_an_installed_wheel_runs_an_sft_step_with_its_shipped_config(tmp_path, arithmetic_tokenizer_dir):
    from aligner.demo import arithmetic

    # The build writes build/ and aligner.egg-info beside pyproject.toml: build a copy of what the wheel holds.
    source = tmp_path / "source"
    for package in ("aligner", "servers"):
        shutil.copytree(REPO_ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", source, "--no-deps", "--no-build-isolation", "--quiet", "-w", dist])
    (wheel,) = dist.glob("aligner-*.whl")

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, symlinks=True)
    python = env_dir / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--quiet", wheel])
    # The heavy dependencies (torch, megatron-core...) from this interpreter's site-packages, as plain path
    # entries: the .pth files there (the editable install of the source tree) are not executed.
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    (purelib / "dependencies.pth").write_text("".join(f"{path}\n" for path in site.getsitepackages()))

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.setdefault("OMP_NUM_THREADS", "1")
    where = _run([python, "-c", "import aligner, aligner.config as c; print(aligner.__file__); print(c.CONF_DIR)"],
                 env=env, cwd=run_dir).split()
    assert all(Path(path).is_relative_to(env_dir) for path in where), where  # the wheel's aligner, its configs
    assert (Path(where[1]) / "gpt_sft.yaml").is_file() and (Path(where[1]) / "base.yaml").is_file()

    train = write_jsonl(tmp_path / "sft.jsonl", arithmetic.sft_records(8, seed=0))
    save_dir = run_dir / "results" / "sft"
    _run([env_dir / "bin" / "aligner", "sft", f"tokenizer.path={arithmetic_tokenizer_dir}",
          f"data.train=[{{path: {train}}}]", "data.split='100,0'", "data.max_seq_length=16",
          "model.architecture.num_layers=1", "model.architecture.hidden_size=32",
          "model.architecture.ffn_hidden_size=64", "trainer.max_steps=1", "trainer.global_batch_size=8",
          "trainer.micro_batch_size=8", "trainer.val_check_interval=0", "logging.progress_bar=false",
          "logging.tensorboard=false", "logging.peak_tflops=1.0", f"checkpoint.save_dir={save_dir}"],
         env=env, cwd=run_dir)
    rows = read_metrics(save_dir, "train")
    assert len(rows) == 1 and rows[0]["loss"] > 0
    assert (save_dir / "step_00000001").is_dir()
