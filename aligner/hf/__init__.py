"""Hugging Face interop: import HF models as aligner checkpoints and export back.

Architectures (layout.ARCHS): Llama (with Llama 3.x RoPE scaling), Qwen2, Qwen3, Mistral, Mixtral,
Qwen3-MoE, GPT-2, Gemma 3 (text).

`layout` holds the pure config transforms, `weights` the tensor ones; `convert` does the file and megatron work;
`sources` resolves every start (`model.init_from`, ...) to a checkpoint, importing HF/GGUF sources into a cache.
CLI: `python -m aligner.hf import|export ...` (see aligner/hf/__main__.py).
"""
from aligner.hf.convert import export_hf, import_gguf, import_hf, read_hf_source
from aligner.hf.layout import ARCHS, gpt_config_from_hf, hf_config_from_gpt
from aligner.hf.weights import hf_to_megatron, megatron_to_hf

__all__ = [
    "ARCHS",
    "export_hf",
    "gpt_config_from_hf",
    "hf_config_from_gpt",
    "hf_to_megatron",
    "import_gguf",
    "import_hf",
    "megatron_to_hf",
    "read_hf_source",
]
