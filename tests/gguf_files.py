"""Tiny GGUF files written with the `gguf` package, laid out as llama.cpp writes a Llama model.

Random weights in the three storage kinds a real file mixes (F32 norms, Q8_0 embedding, Q4_1
matrices, as SmolLM2-135M-Instruct.Q4_1.gguf), a byte-level BPE tokenizer with ChatML tokens and
SmolLM2's template (with its default system prompt).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # unk, bos, eos = pad (as SmolLM2)
MERGES = ["h e", "l l", "Ġ t"]


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (its `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_ins = dict(zip(printable, printable))
    extra = 0
    for byte in range(256):
        if byte not in stand_ins:
            stand_ins[byte] = 256 + extra
            extra += 1
    return [chr(stand_ins[byte]) for byte in range(256)]


def write_tiny_llama_gguf(path: Path, *, seed: int = 0, num_layers: int = 2, hidden: int = 64, heads: int = 4,
                          kv_heads: int = 2, ffn: int = 128, context: int = 128, rope_base: float = 10000.0,
                          tied: bool = True, architecture: str = "llama", rope_scaling: Optional[dict] = None,
                          rope_freqs: Optional[np.ndarray] = None) -> Path:
    """rope_scaling: `{arch}.rope.scaling.<key>` metadata (e.g. {"type": "yarn", "factor": 4.0}); rope_freqs: the
    per-dimension frequency divisors llama.cpp stores for Llama 3.x scaling (float32, head_dim / 2 values)."""
    import gguf

    tokens = SPECIAL_TOKENS + byte_level_alphabet() + [merge.replace(" ", "") for merge in MERGES]
    token_types = [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    vocab = len(tokens)
    rng = np.random.default_rng(seed)

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny test llama")
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope_base)
    writer.add_rope_dimension_count(hidden // heads)
    for key, value in (rope_scaling or {}).items():
        if isinstance(value, str):
            writer.add_string(f"{architecture}.rope.scaling.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"{architecture}.rope.scaling.{key}", value)
        else:
            writer.add_float32(f"{architecture}.rope.scaling.{key}", value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    def matrix(rows: int, cols: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def add(name: str, values: np.ndarray, qtype) -> None:
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    q8, q4, f32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.F32
    head_dim = hidden // heads
    add("token_embd.weight", matrix(vocab, hidden, 0.5), q8)
    for layer in range(num_layers):
        prefix = f"blk.{layer}"
        add(f"{prefix}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32), f32)
        add(f"{prefix}.attn_q.weight", matrix(heads * head_dim, hidden), q4)
        add(f"{prefix}.attn_k.weight", matrix(kv_heads * head_dim, hidden), q4)
        add(f"{prefix}.attn_v.weight", matrix(kv_heads * head_dim, hidden), q4)
        add(f"{prefix}.attn_output.weight", matrix(hidden, heads * head_dim), q4)
        add(f"{prefix}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32), f32)
        add(f"{prefix}.ffn_gate.weight", matrix(ffn, hidden), q4)
        add(f"{prefix}.ffn_up.weight", matrix(ffn, hidden), q4)
        add(f"{prefix}.ffn_down.weight", matrix(hidden, ffn), q4)
    if rope_freqs is not None:
        add("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32), f32)
    add("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32), f32)
    if not tied:
        add("output.weight", matrix(vocab, hidden, 0.5), q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_reference(path: Path):
    """(config, tokenizer, model, dequantised tensors) as transformers reads the file: the model built
    from the config with the weights of `load_gguf_checkpoint` (what `from_pretrained(gguf_file=...)`
    does, without its `accelerate` requirement)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from aligner.hf.gguf import parsed_once

    with parsed_once(path):  # transformers' three reads would otherwise parse the file three times
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        with no_init_weights():  # every weight is overwritten below
            model = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    # assign: the model's parameters are these tensors (no second copy of the weights)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return config, tokenizer, model.eval(), tensors


def aligner_logits(checkpoint: Path, tokens):
    """Logits of an aligner checkpoint (a whole model, or LoRA adapters live on their base) loaded at TP=1 in
    this process (float32, [batch, seq, vocab], on the CPU; the model runs where the runtime puts it: a GPU when
    there is one)."""
    from aligner import checkpointing
    from aligner.models.forward import forward_logits
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
    from aligner.models.lora import load_for_inference
    from aligner.runtime import distributed, seeds

    distributed.initialize(distributed.ParallelConfig())
    try:
        seeds.set_seed(0)  # megatron's model-parallel RNG stream (the weights are loaded over the init)
        cfg = GPTConfig.from_dict(checkpointing.read_meta(checkpoint)["model"])
        model = build_gpt_model(cfg, transformer_config(cfg)).to(distributed.device())
        load_for_inference(checkpoint, [model])  # an adapter checkpoint: onto its base, with live adapters
        return forward_logits([model], tokens, cfg.vocab_size)
    finally:
        distributed.shutdown()


def logits_against_transformers(checkpoint: Path, hf_model, prompts: list[list[int]], name: str):
    """(aligner logits, transformers logits) of the prompts cut to the shortest one's length (causal attention:
    rows of one length need no padding), printing their largest difference beside the largest logit."""
    import torch

    length = min(map(len, prompts))
    tokens = torch.tensor([prompt[:length] for prompt in prompts])
    with torch.no_grad():
        expected = hf_model(tokens).logits
    logits = aligner_logits(checkpoint, tokens)
    print(f"\n[real_model] {name} max |logit difference| {(logits - expected).abs().max().item():.2e}, "
          f"max |logit| {expected.abs().max().item():.1f}")
    return logits, expected
