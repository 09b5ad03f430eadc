"""GGUF files (llama.cpp's format) read through the GGUF reader of `transformers`.

The model config and the tokenizer (with its chat template) come from the file's metadata; the
weights are dequantised under their Hugging Face names, so they take the same import path as an HF
directory (aligner.hf.convert). The reader needs the `gguf` package (the `gguf` extra).
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import torch

from aligner.config import MissingExtraError
from aligner.data.jsonl import DataError
from aligner.runtime.errors import ConfigError

INSTALL_HINT = "reading GGUF files needs the gguf package: pip install 'aligner[gguf]'"
# float32 keeps the values exactly as the gguf package dequantises them (every block format decodes
# to float32); bfloat16 rounds them.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# What a damaged or foreign file makes the metadata parser raise.
_PARSE_ERRORS = (ValueError, struct.error, OSError, KeyError, IndexError, UnicodeDecodeError)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype GGUF weights are dequantised to, by name (float32 | bfloat16)."""
    if name not in DTYPES:
        raise ConfigError(f"dtype={name!r} is not supported for GGUF weights; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def is_gguf_file(path: str | os.PathLike) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def _require_gguf_package() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise MissingExtraError(INSTALL_HINT) from None


def read_gguf_config(path: str | os.PathLike):
    """The transformers config (a PretrainedConfig) of a GGUF file."""
    from transformers import AutoConfig

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"GGUF file {path} does not exist")
    _require_gguf_package()
    try:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except _PARSE_ERRORS as error:
        raise DataError(f"{path}: not a readable GGUF file ({type(error).__name__}: {error})") from None


def read_gguf_tokenizer(path: str | os.PathLike):
    """The file's tokenizer, chat template included (a transformers tokenizer)."""
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except _PARSE_ERRORS as error:
        raise DataError(f"{path}: cannot read the tokenizer ({type(error).__name__}: {error})") from None


def read_gguf_state_dict(path: str | os.PathLike, config, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """The weights of a GGUF file dequantised to `dtype`, under the HF parameter names of `config`
    (its `read_gguf_config`); a tied lm_head is absent, as in an HF directory."""
    from transformers import AutoModelForCausalLM

    target_dtype = torch_dtype(dtype)
    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as error:  # transformers is moving its GGUF code to transformers.integrations.gguf
        import transformers

        raise MissingExtraError(
            f"reading GGUF weights needs transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint, which "
            f"transformers {transformers.__version__} does not have ({error})") from None
    # The reader maps GGUF tensor names to the parameter names of a model of this config: a model
    # on the meta device has the names and allocates nothing.
    with torch.device("meta"):
        names_of = AutoModelForCausalLM.from_config(config)
    try:
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=names_of)["tensors"]
    except _PARSE_ERRORS as error:
        raise DataError(f"{path}: cannot read the weights ({type(error).__name__}: {error})") from None
    for name in tensors:  # one tensor at a time, so only one extra copy is alive
        tensors[name] = tensors[name].to(target_dtype)
    return tensors
