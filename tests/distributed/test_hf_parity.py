"""HF import/export against `transformers` on tiny random models of every supported family.

Megatron logits of an imported model must match transformers' at TP=1, TP=2 and PP=2 (and EP=2
for MoE models); an export must reproduce the original HF tensors and config exactly, also from
checkpoints that were re-saved at TP=2 and at EP=2. One torchrun launch per layout runs every family.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..conftest import REPO_ROOT

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parent / "scripts" / "hf_parity.py"
VOCAB = 100  # not a multiple of 128: exercises vocabulary padding
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=3)
TOLERANCE = 1e-4
# rope_theta 10000 and head_dim 16 put the rotary wavelengths in all three llama3 bands (kept,
# smoothed, divided by the factor) of original_max_position_embeddings 8192.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# family (the work directory's name) -> its HF architecture
FAMILIES = {
    "llama": "llama",  # untied, rope_theta 500000
    "llama3_tied": "llama",  # Llama 3.2-style: llama3 RoPE scaling and tied embeddings
    "qwen2": "qwen2",  # tied, like the small Qwen2 models
    "qwen3": "qwen3",  # q/k norm, head_dim != hidden/heads
    "mistral": "mistral",  # head_dim != hidden/heads
    "gpt2": "gpt2",
    "mixtral": "mixtral",  # 4 experts, top-2, renormalised
    "qwen3_moe": "qwen3_moe",  # q/k norm, 4 experts, top-2 of the full softmax (norm_topk_prob=false)
    "gemma3": "gemma3_text",  # layer 1 sliding-window (RoPE base 10000), layer 2 global (1e6); tied
}
MOE_FAMILIES = ("mixtral", "qwen3_moe")


def hf_config(family: str):
    llama_family = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, **SPECIAL,
    )
    if family == "llama":
        return transformers.LlamaConfig(**llama_family,
                                        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    if family == "llama3_tied":
        return transformers.LlamaConfig(**dict(llama_family, max_position_embeddings=16384),
                                        rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)
    if family == "qwen2":
        return transformers.Qwen2Config(**llama_family, tie_word_embeddings=True)
    if family == "qwen3":
        return transformers.Qwen3Config(**llama_family, head_dim=32)
    if family == "mistral":
        return transformers.MistralConfig(**llama_family, head_dim=32, sliding_window=None)
    if family == "mixtral":
        return transformers.MixtralConfig(**dict(llama_family, intermediate_size=48), num_local_experts=4,
                                          num_experts_per_tok=2, sliding_window=None)
    if family == "gemma3":  # the rows (24 tokens) fit the window: windowed attention is full attention
        return transformers.Gemma3TextConfig(**llama_family, head_dim=32, query_pre_attn_scalar=24, sliding_window=32,
                                             layer_types=["sliding_attention", "full_attention"])
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**llama_family, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=48, norm_topk_prob=False)
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


def make_hf_model(family: str, work: Path, seed: int = 0) -> None:
    """A random HF model in <work>/<family>/hf and transformers' logits on a random batch."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32).eval()
    with torch.no_grad():
        # Not HF's init (zero biases, unit norms, std 0.02): every tensor must carry signal so a
        # misplaced one shows in the logits.
        for name, param in model.named_parameters():
            is_norm = "norm" in name or ".ln_" in name
            param.copy_((1.0 if is_norm and name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(param))
    model.save_pretrained(str(work / family / "hf"))
    save_tokenizer(work / family / "hf")
    tokens = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        logits = model(tokens).logits.float()
    torch.save({"tokens": tokens, "logits": logits}, work / family / "reference.pt")
    if family == "llama3_tied":  # the comparison can see the scaling: plain RoPE gives other logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(str(work / family / "hf"), rope_parameters={
            "rope_type": "default", "rope_theta": LLAMA3_ROPE["rope_theta"]}).eval()
        with torch.no_grad():
            assert (plain(tokens).logits - logits).abs().max() > 10 * TOLERANCE


def parse_result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no RESULT line in output:\n{stdout[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def assert_same_hf_model(original: Path, exported: Path, arch: str) -> None:
    """Identical tensors and config fields, a config transformers loads, identical logits, a tokenizer that loads."""
    expected, actual = load_file(str(original / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and torch.equal(actual[name], tensor), name
    original_config = json.loads((original / "config.json").read_text())
    exported_config = json.loads((exported / "config.json").read_text())
    assert {key: exported_config.get(key) for key in original_config} == original_config
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


def test_every_family_matches_transformers_at_tp1_and_export_round_trips(tmp_path, torchrun):
    for family in FAMILIES:
        make_hf_model(family, tmp_path)
    diffs = parse_result(torchrun(SCRIPT, 1, "tp1", tmp_path, *FAMILIES))
    print("TP=1 max |logit diff|:", diffs)
    for family, arch in FAMILIES.items():
        assert diffs[family] < TOLERANCE, (family, diffs[family])
        assert_same_hf_model(tmp_path / family / "hf", tmp_path / family / "export", arch)


def test_every_family_matches_transformers_at_tp2_pp2_and_moe_at_ep2(tmp_path, torchrun):
    """Also: exports from checkpoints re-saved at TP=2 (llama) and EP=2 (mixtral, experts split over ranks)."""
    for family in FAMILIES:
        make_hf_model(family, tmp_path, seed=1)
    diffs = parse_result(torchrun(SCRIPT, 2, "parallel", tmp_path, *FAMILIES))
    print("TP=2 / PP=2 / EP=2 max |logit diff|:", diffs)
    expected = {f"{family}/{layout}" for family in FAMILIES for layout in ("tp2", "pp2")}
    assert set(diffs) == expected | {f"{family}/ep2" for family in MOE_FAMILIES}
    for layout, diff in diffs.items():
        assert diff < TOLERANCE, (layout, diff)
    for family, layout in (("llama", "tp2"), ("mixtral", "ep2")):
        checkpoint = tmp_path / family / f"ckpt_{layout}"
        parallel = json.loads((checkpoint / "aligner_meta.json").read_text())["parallel"]
        assert parallel.get(
            {"tp2": "tensor_model_parallel_size", "ep2": "expert_model_parallel_size"}[layout]) == 2, parallel
        # A re-saved checkpoint has no hf_source.json: the arch is inferred, special ids come from the tokenizer.
        run_cli("export", "--checkpoint", str(checkpoint), "--output", str(tmp_path / family / f"export_{layout}"))
        assert_same_hf_model(tmp_path / family / "hf", tmp_path / family / f"export_{layout}", FAMILIES[family])
