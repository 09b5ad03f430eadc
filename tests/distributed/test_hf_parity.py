"""HF import/export against `transformers` on tiny random models.

Megatron logits of an imported model must match transformers' at TP=1 (all architectures),
TP=2 and PP=2; an export must reproduce the original HF tensors exactly, also from a
checkpoint that was re-saved at TP=2.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parent / "scripts" / "hf_parity.py"
from ..conftest import REPO_ROOT
VOCAB = 100  # not a multiple of 128: exercises vocabulary padding
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=3)
TOLERANCE = 1e-4


def hf_config(arch: str):
    llama_family = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, **SPECIAL,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**llama_family, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    if arch == "qwen2":  # tied embeddings, like the small Qwen2 models
        return transformers.Qwen2Config(**llama_family, tie_word_embeddings=True)
    if arch == "mistral":  # head_dim != hidden/heads exercises kv_channels
        return transformers.MistralConfig(**llama_family, head_dim=32, sliding_window=None)
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_head=4, n_layer=2, n_positions=64, activation_function="gelu_new", **SPECIAL
    )


def save_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(VOCAB - 4)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(str(directory))


def make_hf_model(arch: str, work: Path, seed: int = 0) -> None:
    """A random HF model in <work>/<arch>/hf and transformers' logits on a random batch."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32).eval()
    with torch.no_grad():
        # Not HF's init (zero biases, unit norms, std 0.02): every tensor must carry signal so a
        # misplaced one shows in the logits.
        for name, param in model.named_parameters():
            is_norm = "norm" in name or ".ln_" in name
            param.copy_((1.0 if is_norm and name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(param))
    model.save_pretrained(str(work / arch / "hf"))
    save_tokenizer(work / arch / "hf")
    tokens = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        logits = model(tokens).logits.float()
    torch.save({"tokens": tokens, "logits": logits}, work / arch / "reference.pt")


def parse_result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no RESULT line in output:\n{stdout[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def assert_same_hf_model(original: Path, exported: Path, arch: str) -> None:
    """Identical tensors, a config transformers loads, identical logits, a tokenizer that loads."""
    expected, actual = load_file(str(original / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and torch.equal(actual[name], tensor), name
    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    assert model.config.model_type == arch
    reference = torch.load(original.parent / "reference.pt")
    with torch.no_grad():
        logits = model(reference["tokens"]).logits
    assert torch.equal(logits, reference["logits"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(exported))
    assert tokenizer.eos_token_id == 2 and tokenizer.convert_tokens_to_ids("w7") == 11
    assert model.config.eos_token_id == 2 and model.config.bos_token_id == 1


def run_cli(*args: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, "-m", "aligner.hf", *args], env=env, capture_output=True, text=True,
                            cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"


def test_import_matches_transformers_and_export_round_trips(tmp_path, torchrun):
    archs = ("llama", "qwen2", "mistral", "gpt2")
    for arch in archs:
        make_hf_model(arch, tmp_path)
    diffs = parse_result(torchrun(SCRIPT, 1, "tp1", tmp_path, *archs))
    print("TP=1 max |logit diff|:", diffs)
    for arch in archs:
        assert diffs[arch] < TOLERANCE, (arch, diffs[arch])
        assert_same_hf_model(tmp_path / arch / "hf", tmp_path / arch / "export", arch)


def test_parity_at_tp2_and_pp2_and_export_from_tp2_checkpoint(tmp_path, torchrun):
    for arch in ("llama", "gpt2"):
        make_hf_model(arch, tmp_path, seed=1)
    diffs = parse_result(torchrun(SCRIPT, 2, "parallel", tmp_path))
    print("TP=2 / PP=2 max |logit diff|:", diffs)
    assert set(diffs) == {"llama/tp2pp1", "gpt2/tp2pp1", "llama/tp1pp2", "gpt2/tp1pp2"}
    for layout, diff in diffs.items():
        assert diff < TOLERANCE, (layout, diff)
    checkpoint = tmp_path / "llama" / "ckpt_tp2"
    assert json.loads((checkpoint / "aligner_meta.json").read_text())["parallel"]["tensor_model_parallel_size"] == 2
    # A re-saved checkpoint has no hf_source.json: the arch is inferred, special ids come from the tokenizer.
    run_cli("export", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "llama" / "export_tp2"))
    assert_same_hf_model(tmp_path / "llama" / "hf", tmp_path / "llama" / "export_tp2", "llama")
