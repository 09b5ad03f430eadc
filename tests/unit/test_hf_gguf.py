"""GGUF import (python -m aligner.hf import --gguf) on tiny GGUF files written here, and the one-line
user errors of the HF CLI.

The reference is transformers reading the same file: its config, its tokenizer and the weights its
`load_gguf_checkpoint` dequantises. The real model (SmolLM2) is tested in tests/real_model.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ..conftest import REPO_ROOT
from ..gguf_files import aligner_logits, transformers_reference, write_tiny_llama_gguf

MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "tell me the news"},
]


def run_hf_cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    """`python -m aligner.hf ARGS` (with `prelude` run first in the same interpreter)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    command = [sys.executable, "-m", "aligner.hf", *args]
    if prelude:
        code = (f"{prelude}\nimport runpy, sys\nsys.argv = ['aligner.hf', *{list(args)!r}]\n"
                "runpy.run_module('aligner.hf', run_name='__main__')")
        command = [sys.executable, "-c", code]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)


@pytest.mark.parametrize("tied", [True, False], ids=["tied_embeddings", "separate_output_layer"])
def test_gguf_import_matches_transformers_logits_tokenizer_and_chat_template(tmp_path, tied):
    from aligner.hf import import_gguf, read_hf_source
    from aligner.tokenizer import Tokenizer

    gguf_file = write_tiny_llama_gguf(tmp_path / "tiny.gguf", tied=tied)
    import_gguf(gguf_file, tmp_path / "ckpt")
    config, hf_tokenizer, hf_model, _ = transformers_reference(gguf_file)
    assert config.tie_word_embeddings is tied

    # The tokenizer and chat template come from the file: same ids as transformers' own rendering.
    tokenizer = Tokenizer(tmp_path / "ckpt" / "tokenizer")
    prompt = tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)[0]
    assert prompt == hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1, 2, 2)
    source = read_hf_source(tmp_path / "ckpt")
    assert (source["arch"], source["dtype"], source["eos_token_id"]) == ("llama", "float32", 2)

    tokens = torch.tensor([prompt])
    with torch.no_grad():
        expected = hf_model(tokens).logits
    logits = aligner_logits(tmp_path / "ckpt", tokens)
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() < 1e-4
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_gguf_import_in_bfloat16_rounds_the_dequantised_weights_and_exports_in_bfloat16(tmp_path):
    from safetensors.torch import load_file

    from aligner.hf import export_hf

    gguf_file = write_tiny_llama_gguf(tmp_path / "tiny.gguf", seed=1)
    result = run_hf_cli("import", "--gguf", str(gguf_file), "--output", str(tmp_path / "ckpt"), "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith(f"-> {tmp_path / 'ckpt'}")
    export_hf(tmp_path / "ckpt", tmp_path / "export")  # the dtype recorded at import: bfloat16
    _, _, _, dequantised = transformers_reference(gguf_file)
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert json.loads((tmp_path / "export" / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(exported) == sorted(dequantised)
    for name, tensor in dequantised.items():
        assert exported[name].dtype == torch.bfloat16
        assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name
    assert (tmp_path / "export" / "chat_template.jinja").is_file()


def test_gguf_import_parses_the_file_once_and_restores_the_reader_class(tmp_path, monkeypatch):
    """transformers builds a GGUFReader per read (config, tokenizer, weights) and the RoPE check one more:
    within `parsed_once` they share one parse (the values are the other tests' business)."""
    import gguf

    from aligner.hf import import_gguf
    from aligner.hf.gguf import parsed_once

    gguf_file = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    other_file = write_tiny_llama_gguf(tmp_path / "other.gguf", seed=1)
    parsed = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            parsed.append(Path(path).resolve())
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    import_gguf(gguf_file, tmp_path / "ckpt")
    assert parsed == [gguf_file.resolve()]
    assert gguf.GGUFReader is CountingReader

    parsed.clear()
    with pytest.raises(RuntimeError, match="inside"), parsed_once(tmp_path / "." / "tiny.gguf"):
        shared = gguf.GGUFReader(str(gguf_file))
        assert gguf.GGUFReader(gguf_file) is shared  # the same file by another spelling
        assert gguf.GGUFReader(other_file) is not gguf.GGUFReader(other_file)  # any other file: parsed each time
        raise RuntimeError("inside")
    assert parsed == [gguf_file.resolve()] + [other_file.resolve()] * 2
    assert gguf.GGUFReader is CountingReader  # restored after an error too


def llama_cpp_rope_divisors(rope_theta: float, head_dim: int, factor: float,
                            high_freq_factor: float = 4.0) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for Llama 3.x RoPE scaling (low_freq_factor 1,
    original context 8192): per dimension pair, what its base frequency (float32, as the converter computes
    it) is divided by: 1 for short wavelengths, the factor for long ones, a smooth blend between."""
    base = (1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)).double()
    wavelength = 2 * math.pi / base
    blend = (8192 / wavelength - 1.0) / (high_freq_factor - 1.0)
    medium = 1.0 / ((1.0 - blend) / factor + blend)
    divisors = torch.where(wavelength < 8192 / high_freq_factor, torch.ones_like(base),
                           torch.where(wavelength > 8192, torch.full_like(base, factor), medium))
    return divisors.float().numpy()


@pytest.mark.parametrize("rope_theta,head_dim,factor", [(10000.0, 16, 8.0), (500000.0, 128, 8.0), (500000.0, 64, 32.0)],
                         ids=["tiny", "llama3.1_8b", "llama3.2_1b"])
def test_gguf_rope_freqs_read_as_llama3_scaling_whose_frequencies_are_the_files(rope_theta, head_dim, factor, tmp_path):
    """llama.cpp stores Llama 3.x scaling only as `rope_freqs` divisors (transformers' GGUF reader drops
    them): the factor read back gives, in megatron and in transformers, base frequency / divisor."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from aligner.hf.gguf import read_gguf_config
    from aligner.hf.layout import gpt_config_from_hf, hf_config_from_gpt

    divisors = llama_cpp_rope_divisors(rope_theta, head_dim, factor)
    assert len(set(divisors.tolist())) > 2  # every band: kept, divided by the factor, blended
    gguf_file = write_tiny_llama_gguf(tmp_path / "scaled.gguf", hidden=2 * head_dim, heads=2, kv_heads=1,
                                      rope_base=rope_theta, rope_freqs=divisors)
    cfg, _ = gpt_config_from_hf(read_gguf_config(gguf_file))
    assert cfg.llama3_rope_scaling_factor == factor and cfg.rotary_base == rope_theta
    expected = (1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
                / torch.from_numpy(divisors).double())
    megatron = RotaryEmbedding(kv_channels=cfg.head_dim, rotary_percent=1.0, rotary_base=int(cfg.rotary_base),
                               rope_scaling=True, rope_scaling_factor=cfg.llama3_rope_scaling_factor,
                               use_cpu_initialization=True)
    torch.testing.assert_close(megatron.inv_freq.double(), expected, rtol=1e-6, atol=0)
    hf = LlamaRotaryEmbedding(hf_config_from_gpt(cfg, "llama"))  # what an export of the import computes
    torch.testing.assert_close(hf.inv_freq.double(), expected, rtol=1e-6, atol=0)


def test_gguf_with_rope_freqs_imports_with_llama3_scaling_and_divisors_of_one_as_plain_rope(tmp_path):
    from aligner import checkpointing
    from aligner.hf import import_gguf
    from aligner.hf.gguf import read_gguf_config

    scaled = write_tiny_llama_gguf(tmp_path / "scaled.gguf", rope_freqs=llama_cpp_rope_divisors(10000.0, 16, 8.0))
    import_gguf(scaled, tmp_path / "scaled")
    assert checkpointing.read_meta(tmp_path / "scaled")["model"]["llama3_rope_scaling_factor"] == 8.0
    plain = write_tiny_llama_gguf(tmp_path / "plain.gguf", rope_freqs=np.ones(8, dtype=np.float32),
                                  rope_scaling={"type": "none"})
    assert read_gguf_config(plain).rope_parameters["rope_type"] == "default"


def _tiny_llama_config() -> dict:
    return {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 64}


def _user_error_cases(root):
    """(name, CLI args, text the one error line must contain) for each kind of bad input."""
    from safetensors.torch import save_file

    root.mkdir()
    (root / "no_config").mkdir()
    bad_json = root / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text('{"model_type": "llama",')
    unsupported = root / "unsupported"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    truncated = root / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_text(json.dumps(_tiny_llama_config()))
    save_file({"model.embed_tokens.weight": torch.ones(300, 64)}, str(truncated / "model.safetensors"))
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    garbage = root / "garbage.gguf"
    garbage.write_bytes(b"this is not a GGUF file" * 10)
    cut = root / "cut.gguf"
    cut.write_bytes(write_tiny_llama_gguf(root / "whole.gguf").read_bytes()[:20000])
    yarn = write_tiny_llama_gguf(root / "yarn.gguf",
                                 rope_scaling={"type": "yarn", "factor": 4.0, "original_context_length": 32})
    linear = write_tiny_llama_gguf(root / "linear.gguf", rope_scaling={"type": "linear", "factor": 4.0})
    linear_factor = write_tiny_llama_gguf(root / "linear_factor.gguf", rope_scaling={"factor": 4.0})
    # Llama 3.x-style divisors, but with a high_freq_factor megatron's llama3 scaling does not take.
    other_divisors = write_tiny_llama_gguf(root / "other_divisors.gguf",
                                           rope_freqs=llama_cpp_rope_divisors(10000.0, 16, 8.0, high_freq_factor=2.0))
    out = str(root / "out")
    return [
        ("missing_dir", ["import", "--hf-dir", str(root / "nope"), "--output", out], f"{root / 'nope'} does not exist"),
        ("missing_config", ["import", "--hf-dir", str(root / "no_config"), "--output", out], "has no config.json"),
        ("bad_json", ["import", "--hf-dir", str(bad_json), "--output", out],
         f"{bad_json / 'config.json'}:1: not valid JSON"),
        ("unsupported_arch", ["import", "--hf-dir", str(unsupported), "--output", out],
         f"{unsupported / 'config.json'}: model_type='bert' is not supported"),
        ("truncated_safetensors", ["import", "--hf-dir", str(truncated), "--output", out],
         f"{truncated / 'model.safetensors'}: damaged or truncated safetensors file"),
        ("missing_gguf", ["import", "--gguf", str(root / "nope.gguf"), "--output", out],
         f"GGUF file {root / 'nope.gguf'} does not exist"),
        ("garbage_gguf", ["import", "--gguf", str(garbage), "--output", out], f"{garbage}: not a readable GGUF file"),
        ("truncated_gguf", ["import", "--gguf", str(cut), "--output", out], f"{cut}: not a readable GGUF file"),
        ("gguf_yarn", ["import", "--gguf", str(yarn), "--output", out],
         f"{yarn}: llama.rope.scaling.type='yarn' is not supported: only plain RoPE and Llama 3.x scaling"),
        ("gguf_linear", ["import", "--gguf", str(linear), "--output", out],
         f"{linear}: llama.rope.scaling.type='linear' is not supported"),
        ("gguf_linear_factor", ["import", "--gguf", str(linear_factor), "--output", out],
         f"{linear_factor}: llama.rope.scaling.factor=4.0 is not supported: linear RoPE scaling"),
        ("gguf_other_rope_freqs", ["import", "--gguf", str(other_divisors), "--output", out],
         f"{other_divisors}: rope_freqs.weight=[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, "),
        ("export_into_used_dir", ["export", "--checkpoint", str(root / "nope"), "--output", str(truncated)],
         "is not empty"),
    ]


# Runs the CLI's main through run_main once per case in one interpreter (a process per case would
# cost seconds each); the end-to-end `python -m aligner.hf` wiring is covered by the other tests.
_RUN_CASES = """
import contextlib, io, json, sys
from aligner.config import run_main
from aligner.hf.__main__ import main
results = []
for args in json.loads(sys.argv[1]):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            run_main(lambda: main(args))
            status = 0
        except SystemExit as exit:
            status = exit.code
    results.append([status, stderr.getvalue()])
print("RESULTS " + json.dumps(results))
"""


def run_cli_cases(arg_lists: list[list[str]]) -> list[tuple[int, str]]:
    """(exit status, stderr) of the HF CLI's main through run_main for each argument list, in one interpreter."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-c", _RUN_CASES, json.dumps(arg_lists)],
                            capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    return [tuple(outcome) for outcome in json.loads(result.stdout.split("RESULTS ", 1)[1])]


def test_hf_cli_user_errors_are_one_line_with_exit_status_2(tmp_path):
    cases = _user_error_cases(tmp_path / "inputs")
    outcomes = run_cli_cases([args for _, args, _ in cases])
    for (name, _, expected), (status, stderr) in zip(cases, outcomes):
        lines = stderr.strip().splitlines()
        assert status == 2 and len(lines) == 1 and lines[0].startswith("error: "), (name, status, stderr[-3000:])
        assert expected in lines[0], (name, lines[0])
    assert not [path for path in (tmp_path / "inputs").iterdir() if path.name.startswith("out")]  # nothing written


def test_gguf_import_without_the_gguf_package_names_the_extra(tmp_path):
    gguf_file = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    # sys.modules[name] = None makes `import gguf` raise ImportError, as when it is not installed.
    result = run_hf_cli("import", "--gguf", str(gguf_file), "--output", str(tmp_path / "ckpt"),
                        prelude="import sys; sys.modules['gguf'] = None")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == "error: reading GGUF files needs the gguf package: pip install 'aligner[gguf]'"
