"""Import a Hugging Face model directory (or a GGUF file) into an aligner checkpoint, and export one back.

Both directions go through the full TP=1/PP=1 megatron model in one process; the checkpoint
itself is a megatron dist_checkpoint, so an imported model loads at any TP/PP layout, and a
checkpoint saved at any layout is resharded to TP=1 on export.

Besides the files of `aligner.checkpointing`, an imported checkpoint holds `hf_source.json`
(the HF architecture, special token ids, dtype and generation config of the source), so an
export writes back the same kind of model. Checkpoints without it (e.g. a training step saved
by a trainer) export to the architecture inferred from the model config.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from aligner import checkpointing
from aligner.config import OutputError
from aligner.data.jsonl import DataError, read_json
from aligner.hf.layout import (
    gpt_config_from_hf,
    hf_config_from_gpt,
    hf_to_megatron,
    infer_arch,
    lora_to_hf,
    megatron_to_hf,
)
from aligner.models.gpt import GPTConfig
from aligner.runtime.errors import ConfigError

HF_SOURCE_FILE = "hf_source.json"
# Tokenizer files copied along with the weights (whatever of these the directory has).
TOKENIZER_PATTERNS = (
    "tokenizer*.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_hf_config(hf_dir: str | os.PathLike) -> dict:
    directory = Path(hf_dir)
    if not directory.is_dir():
        raise ConfigError(f"HF model directory {directory} does not exist")
    path = directory / "config.json"
    if not path.is_file():
        raise ConfigError(f"{hf_dir} has no config.json; expected a Hugging Face model directory")
    return read_json(path)


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except SafetensorError as error:
        raise DataError(f"{path}: damaged or truncated safetensors file ({error})") from None


def _load_pytorch_bin(path: Path) -> dict[str, torch.Tensor]:
    import pickle
    import zipfile

    try:
        # weights_only: a .bin is a pickle; refuse anything but tensors.
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as error:
        raise DataError(f"{path}: damaged, truncated or not a tensors-only pytorch file ({error})") from None


def read_hf_state_dict(hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All weights of an HF model directory: safetensors (single or sharded), else pytorch .bin."""
    directory = Path(hf_dir)
    for single, index, load in (
        ("model.safetensors", "model.safetensors.index.json", _load_safetensors),
        ("pytorch_model.bin", "pytorch_model.bin.index.json", _load_pytorch_bin),
    ):
        if (directory / single).is_file():
            return dict(load(directory / single))
        if (directory / index).is_file():
            weight_map = read_json(directory / index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise DataError(f"{directory / index}: no 'weight_map' object")
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                if not (directory / shard).is_file():
                    raise DataError(f"{directory / index} names shard {shard}, which is missing")
                state.update(load(directory / shard))
            return state
    raise ConfigError(
        f"{directory} has no weights: expected model.safetensors, model.safetensors.index.json (+ shards), "
        "pytorch_model.bin or pytorch_model.bin.index.json"
    )


@contextlib.contextmanager
def _single_model_parallel_group() -> Iterator[None]:
    """TP=1/PP=1 parallel state for the duration (started here unless the caller already has it)."""
    from megatron.core import parallel_state

    from aligner.runtime.distributed import ParallelConfig, initialize, shutdown

    if parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if (tp, pp) != (1, 1):
            raise RuntimeError(
                f"HF import/export runs at TP=1/PP=1, but this process is initialised at TP={tp}/PP={pp}; "
                "run it in its own process (python -m aligner.hf ...)"
            )
        yield
        return
    started_process_group = not dist.is_initialized()
    initialize(ParallelConfig())
    try:
        yield
    finally:
        if started_process_group:
            shutdown()
        else:
            parallel_state.destroy_model_parallel()


def _build_model(cfg: GPTConfig) -> torch.nn.Module:
    """The TP=1 model; its random initial weights are overwritten, so the caller's RNG is left alone."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    from aligner.models.gpt import build_gpt_model, transformer_config

    with torch.random.fork_rng(devices=[]):
        if "model-parallel-rng" not in get_cuda_rng_tracker().get_states():
            model_parallel_cuda_manual_seed(0)  # megatron's init forks this stream
        return build_gpt_model(cfg, transformer_config(cfg))


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _copy_tokenizer_files(source: Path, target: Path) -> list[str]:
    copied = []
    for pattern in TOKENIZER_PATTERNS:
        for path in sorted(source.glob(pattern)):
            if path.is_file():
                shutil.copy2(path, target / path.name)
                copied.append(path.name)
    return copied


def _torch_dtype_name(state: dict[str, torch.Tensor]) -> str:
    for tensor in state.values():
        if tensor.is_floating_point():
            return str(tensor.dtype).removeprefix("torch.")
    return "float32"


def _model_config(hf_config: dict, source: Path, make_vocab_size_divisible_by: int) -> tuple[GPTConfig, str]:
    """gpt_config_from_hf, its errors prefixed with the file the config came from."""
    try:
        return gpt_config_from_hf(hf_config, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    except ValueError as error:
        raise ConfigError(f"{source}: {error}") from None


def import_hf(
    hf_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    make_vocab_size_divisible_by: int = 128,
) -> Path:
    """Convert an HF model directory (an architecture of layout.ARCHS) into an aligner checkpoint at `output_dir`.

    The weights are held in float32 (lossless for bf16/fp16 sources); the tokenizer files are
    copied into the checkpoint. Runs at TP=1/PP=1 in this process; the result loads at any layout.
    """
    hf_dir = Path(hf_dir)
    hf_config = read_hf_config(hf_dir)
    cfg, arch = _model_config(hf_config, hf_dir / "config.json", make_vocab_size_divisible_by)
    hf_state = read_hf_state_dict(hf_dir)
    generation_config = hf_dir / "generation_config.json"
    source = {
        "source_dir": str(hf_dir.resolve()),
        "dtype": _torch_dtype_name(hf_state),
        "generation_config": read_json(generation_config) if generation_config.is_file() else None,
    }
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = Path(scratch) / "tokenizer"
        tokenizer_dir.mkdir()
        has_tokenizer = bool(_copy_tokenizer_files(hf_dir, tokenizer_dir))
        return _write_imported_checkpoint(cfg, arch, hf_config, hf_state, output_dir,
                                          tokenizer_dir if has_tokenizer else None, source)


def import_gguf(
    gguf_file: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    dtype: str = "float32",
    make_vocab_size_divisible_by: int = 128,
) -> Path:
    """Convert a GGUF file (dequantised to `dtype`: float32 | bfloat16) into an aligner checkpoint.

    The config, tokenizer and chat template come from the file; then as `import_hf`.
    """
    from aligner.hf.gguf import read_gguf_config, read_gguf_state_dict, read_gguf_tokenizer, torch_dtype

    torch_dtype(dtype)  # an unknown dtype fails before the file is read
    gguf_file = Path(gguf_file)
    config = read_gguf_config(gguf_file)
    hf_config = config.to_dict()
    cfg, arch = _model_config(hf_config, gguf_file, make_vocab_size_divisible_by)
    tokenizer = read_gguf_tokenizer(gguf_file)
    hf_state = read_gguf_state_dict(gguf_file, config, dtype)
    source = {"source_file": str(gguf_file.resolve()), "dtype": dtype, "generation_config": None}
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer.save_pretrained(scratch)
        return _write_imported_checkpoint(cfg, arch, hf_config, hf_state, output_dir, Path(scratch), source)


def _write_imported_checkpoint(
    cfg: GPTConfig,
    arch: str,
    hf_config: dict,
    hf_state: dict[str, torch.Tensor],
    output_dir: str | os.PathLike,
    tokenizer_dir: Optional[Path],
    source: dict,
) -> Path:
    """The one converter behind every import: HF-named weights -> TP=1 megatron model -> checkpoint,
    plus `hf_source.json` (`source` and what export needs). Empties `hf_state` as it converts it."""
    megatron_state = hf_to_megatron({name: t.float() for name, t in hf_state.items()}, cfg, arch)
    hf_state.clear()

    with _single_model_parallel_group():
        model = _build_model(cfg)
        # `_extra_state` entries belong to the module (None for local layers); strict loading wants them.
        for name, value in model.state_dict().items():
            if name.endswith("_extra_state"):
                megatron_state[name] = value
        model.load_state_dict(megatron_state, strict=True)
        del megatron_state
        final = checkpointing.save(output_dir, [model], model_config=cfg.to_dict(), tokenizer_dir=tokenizer_dir)
        if _is_rank_zero():
            source = {
                "arch": arch,
                **source,
                "bos_token_id": hf_config.get("bos_token_id"),
                "eos_token_id": hf_config.get("eos_token_id"),
                "pad_token_id": hf_config.get("pad_token_id"),
            }
            (final / HF_SOURCE_FILE).write_text(json.dumps(source, indent=2, sort_keys=True))
        if dist.is_initialized():
            dist.barrier()
    return final


def read_hf_source(checkpoint_dir: str | os.PathLike) -> dict:
    """What `import_hf` recorded about the source model ({} for checkpoints not imported from HF)."""
    path = Path(checkpoint_dir) / HF_SOURCE_FILE
    return read_json(path) if path.is_file() else {}


def _special_token_ids(checkpoint_dir: Path, source: dict) -> dict[str, Optional[int]]:
    names = ("bos_token_id", "eos_token_id", "pad_token_id")
    if source:
        return {name: source.get(name) for name in names}
    tokenizer_dir = checkpoint_dir / checkpointing.TOKENIZER_DIR
    if not tokenizer_dir.is_dir():
        return {name: None for name in names}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    return {name: getattr(tokenizer, name) for name in names}


LORA_EXPORTS = ("merge", "peft")
ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def export_hf(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    arch: Optional[str] = None,
    dtype: Optional[str] = None,
    lora: str = "merge",
    base: Optional[str | os.PathLike] = None,
) -> Path:
    """Write an aligner checkpoint as an HF model directory (config.json, model.safetensors, tokenizer).

    arch: one of layout.ARCHS; default: the imported source's, else inferred from the model.
    dtype: float32 | bfloat16 | float16; default: the imported source's, else float32.
    The checkpoint may have been saved at any TP/PP layout; it is loaded at TP=1/PP=1 here.
    A LoRA adapter checkpoint is loaded onto its base (`base`, default the path it recorded) and written
    either merged into the weights (lora="merge": a plain HF model) or as a PEFT adapter directory
    (lora="peft": adapter_config.json + adapter_model.safetensors, for `peft.PeftModel.from_pretrained`
    on the HF export of the base).
    """
    from safetensors.torch import save_file

    from aligner.models import lora as lora_adapters

    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    if output_dir.exists() and any(output_dir.iterdir()):
        # Never mix with (or delete) an existing model's files: stale shards would be loaded too.
        raise OutputError(f"export output directory {output_dir} is not empty; choose a new directory")
    if lora not in LORA_EXPORTS:
        raise ConfigError(f"lora={lora!r}: choose one of {list(LORA_EXPORTS)}")
    meta = checkpointing.read_meta(checkpoint_dir)
    peft_meta = meta.get("peft")
    if peft_meta is None and (lora == "peft" or base is not None):
        raise ConfigError(f"{checkpoint_dir} is a whole model, not LoRA adapters: --lora peft and --base apply to "
                          "adapter checkpoints")
    base_dir = lora_adapters.adapter_base(checkpoint_dir, peft_meta, base) if peft_meta is not None else None
    cfg = GPTConfig.from_dict(meta["model"])
    source = read_hf_source(checkpoint_dir) or (read_hf_source(base_dir) if base_dir is not None else {})
    arch = arch or source.get("arch") or infer_arch(cfg)
    dtype = dtype or source.get("dtype") or "float32"
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported for export; choose one of {sorted(_DTYPES)}")
    hf_config = hf_config_from_gpt(cfg, arch, dtype=dtype, **_special_token_ids(checkpoint_dir, source))

    with _single_model_parallel_group():
        model = _build_model(cfg)
        lora_adapters.load_for_inference(checkpoint_dir, [model], base_dir)
        if lora == "peft":
            adapters = {f"{module_name}.weight": (module.lora_a.detach(), module.lora_b.detach())
                        for module_name, module in model.named_modules() if hasattr(module, "lora_a")}
        elif base_dir is not None:
            lora_adapters.merge([model])
        megatron_state = {name: t for name, t in model.state_dict().items()
                          if not name.endswith("_extra_state") and not lora_adapters.is_adapter_key(name)}
    if lora == "peft":
        hf_adapters = lora_to_hf(adapters, cfg, arch)
        hf_state = {f"base_model.model.{module}.lora_{part}.weight": tensor.to(_DTYPES[dtype])
                    for module, pair in hf_adapters.items() for part, tensor in zip("AB", pair)}
        adapter_config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": peft_meta["rank"], "lora_alpha": peft_meta["alpha"],
            "lora_dropout": peft_meta["dropout"], "bias": "none", "use_rslora": False, "fan_in_fan_out": arch == "gpt2",
            # the modules' last two name parts: GPT-2 has a c_proj in attention and in the MLP
            "target_modules": sorted({".".join(module.split(".")[-2:]) for module in hf_adapters}),
            "base_model_name_or_path": source.get("source_dir") or str(base_dir), "inference_mode": True,
        }
    else:
        hf_state = {name: t.to(_DTYPES[dtype]) for name, t in megatron_to_hf(megatron_state, cfg, arch).items()}

    if _is_rank_zero():
        output_dir.mkdir(parents=True, exist_ok=True)
        if lora == "peft":
            (output_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2, sort_keys=True))
            save_file(hf_state, str(output_dir / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
        else:
            hf_config.save_pretrained(str(output_dir))
            save_file(hf_state, str(output_dir / "model.safetensors"), metadata={"format": "pt"})
            if source.get("generation_config"):
                (output_dir / "generation_config.json").write_text(json.dumps(source["generation_config"], indent=2))
        tokenizer_dir = checkpoint_dir / checkpointing.TOKENIZER_DIR
        if tokenizer_dir.is_dir():
            for path in tokenizer_dir.iterdir():
                if path.is_file():
                    shutil.copy2(path, output_dir / path.name)
    if dist.is_initialized():
        dist.barrier()
    return output_dir
