"""GGUF files (llama.cpp's format) read through the GGUF reader of `transformers`.

The model config and the tokenizer (with its chat template) come from the file's metadata; the
weights are dequantised under their Hugging Face names, so they take the same import path as an HF
directory (aligner.hf.convert). The reader needs the `gguf` package (the `gguf` extra).

RoPE scaling is read here from the file itself: transformers' reader (5.x) maps neither a Llama file's
`{arch}.rope.scaling.*` keys nor its `rope_freqs` tensor into the config, so a scaled model would
otherwise import as plain RoPE.
"""
from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path
from typing import Iterator

import torch

from aligner.config import MissingExtraError
from aligner.runtime.errors import ConfigError, DataError

INSTALL_HINT = "reading GGUF files needs the gguf package: pip install 'aligner[gguf]'"
# float32 keeps the values exactly as the gguf package dequantises them (every block format decodes
# to float32); bfloat16 rounds them.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# What a damaged or foreign file makes the metadata parser raise.
_PARSE_ERRORS = (ValueError, struct.error, OSError, KeyError, IndexError, UnicodeDecodeError)
# llama.cpp's tensor of per-dimension RoPE frequency divisors (Llama 3.x scaling): it rotates dimension
# pair i at base_frequency[i] / rope_freqs[i].
ROPE_FREQS_TENSOR = "rope_freqs.weight"
# How close the frequencies megatron computes for the scaling read from `rope_freqs` must be to the ones
# the file prescribes: float32 rounding (both sides compute in float32), far below any change of factor.
_ROPE_FREQS_RTOL = 1e-5
# The llama3 scaling parameters besides the factor that a `rope_freqs` tensor is matched against (Llama 3.1's,
# megatron-core's RotaryEmbedding defaults): llama.cpp keeps only the divisors they produce.
LLAMA31_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


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


@contextlib.contextmanager
def parsed_once(path: str | os.PathLike) -> Iterator[None]:
    """Within the block, every `gguf.GGUFReader` of `path` (the same resolved file) is one reader, parsed on
    first use; a reader of any other file is made as before. `gguf.GGUFReader` is restored on exit.

    Why: transformers' `from_pretrained(gguf_file=...)` and `load_gguf_checkpoint` build a new reader on every
    call, so an import (config, RoPE scaling, tokenizer, weights) parses the file 4 times, and the parse of the
    metadata, element by element for a large vocabulary, dominates: Gemma 3 270M Q4_K_M (262,144 tokens) took
    25-45 s a parse, 163 s an import (147 s of CPU), of which 6 s dequantising the weights; parsed once, the
    import takes 78 s of CPU (AMD EPYC, 2 cores). The readers only read (fields, tensors on a read-only
    memory map), so one can serve every call. It swaps a module attribute for the duration of the block,
    process-wide: blocks in concurrent threads could restore it out of order.
    """
    _require_gguf_package()
    import gguf

    original, target = gguf.GGUFReader, Path(path).resolve()
    shared = None

    def reader(file, *args, **kwargs):
        nonlocal shared
        if args or kwargs or Path(file).resolve() != target:  # another file, or another mode
            return original(file, *args, **kwargs)
        if shared is None:
            shared = original(file)
        return shared

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def read_gguf_config(path: str | os.PathLike):
    """The transformers config (a PretrainedConfig) of a GGUF file."""
    from transformers import AutoConfig

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"GGUF file {path} does not exist")
    _require_gguf_package()
    try:
        with parsed_once(path):  # transformers' reader and ours
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
            scaling = read_gguf_rope_scaling(path, config)
    except ConfigError:  # a ValueError too, but the file was read: it holds something unsupported
        raise
    except _PARSE_ERRORS as error:
        raise DataError(f"{path}: not a readable GGUF file ({type(error).__name__}: {error})") from None
    if scaling is not None:
        config.rope_parameters = {**config.rope_parameters, **scaling}
    return config


def read_gguf_rope_scaling(path: Path, config) -> dict | None:
    """The RoPE scaling of a GGUF file as config `rope_parameters` entries (None: plain RoPE).

    Llama 3.x scaling, which llama.cpp stores as the `rope_freqs` divisors, is read back into its factor
    when megatron's llama3 scaling of that factor gives the frequencies the file prescribes; any other
    scaling (`{arch}.rope.scaling.type` linear/yarn/longrope, a scaling factor, other divisors) is a
    ConfigError naming the key.
    """
    import gguf  # the optional extra; read_gguf_config checked it is there

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    prefix = f"{arch}.rope."

    def value(key: str):
        field = reader.fields.get(prefix + key)
        return None if field is None else field.contents()

    def unsupported(key: str, found, why: str) -> ConfigError:
        return ConfigError(f"{path}: {key}={found!r} is not supported: {why}")

    scaling_type = value("scaling.type")
    if scaling_type not in (None, "none"):
        raise unsupported(prefix + "scaling.type", scaling_type,
                          "only plain RoPE and Llama 3.x scaling (a rope_freqs tensor) are implemented")
    for key in ("scaling.factor", "scale_linear"):  # llama.cpp scales positions linearly by either
        factor = value(key)
        if factor not in (None, 0.0, 1.0):
            raise unsupported(prefix + key, factor, "linear RoPE scaling is not implemented")
    divisors = next((tensor for tensor in reader.tensors if tensor.name == ROPE_FREQS_TENSOR), None)
    if divisors is None:
        return None
    divisors = torch.from_numpy(gguf.quants.dequantize(divisors.data, divisors.tensor_type).copy()).double().flatten()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    factor = _llama3_factor(divisors, config.rope_parameters["rope_theta"], head_dim)
    if factor is None:
        if torch.all(divisors == 1.0):
            return None  # divisors of 1: plain RoPE
        raise unsupported(ROPE_FREQS_TENSOR, [float(f"{divisor:.6g}") for divisor in divisors.tolist()],
                          "these per-dimension RoPE divisors are not Llama 3.x scaling as megatron-core computes it "
                          f"({', '.join(f'{key}={fixed:g}' for key, fixed in LLAMA31_ROPE.items())})")
    return {"rope_type": "llama3", "factor": factor, **LLAMA31_ROPE}


def _llama3_factor(divisors: torch.Tensor, rope_theta: float, head_dim: int) -> float | None:
    """The llama3 scaling factor whose frequencies, as megatron computes them, are the base frequencies over
    `divisors` (float64, one per dimension pair); None if no factor gives them."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding  # megatron's import order

    if divisors.shape != (head_dim // 2,) or rope_theta != int(rope_theta) or torch.all(divisors == 1.0):
        return None
    # Dimensions whose wavelength exceeds the original context (Llama 3.x: the lowest frequencies) are divided
    # by the factor itself; a file without any is refused by the check below.
    factor = float(divisors.max())
    base = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    scaled = RotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, rotary_base=int(rope_theta), rope_scaling=True,
                             rope_scaling_factor=factor, use_cpu_initialization=True).inv_freq.double()
    return factor if torch.allclose(scaled, base / divisors, rtol=_ROPE_FREQS_RTOL, atol=0.0) else None


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
