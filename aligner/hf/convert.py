"""Import a Hugging Face model directory (or a GGUF file) into an aligner checkpoint, and export one back.

Both directions go through the full TP=1/PP=1 megatron model in one process; the checkpoint
itself is a megatron dist_checkpoint, so an imported model loads at any TP/PP layout, and a
checkpoint saved at any layout is resharded to TP=1 on export.

Besides the files of `aligner.checkpointing`, an imported checkpoint holds `hf_source.json`
(the HF architecture, special token ids, dtype and generation config of the source), so an
export writes back the same kind of model. Checkpoints without it (e.g. a training step saved
by a trainer) export to the architecture inferred from the model config.

Both directions write their output the same way (`_staged_output`): never into an input, never over a
directory that is not their own earlier result unless told to, and through a staging directory that
replaces the output only when complete.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from aligner import checkpointing
from aligner.config import OutputError
from aligner.hf.gguf import parsed_once, read_gguf_config, read_gguf_state_dict, read_gguf_tokenizer, torch_dtype
from aligner.hf.layout import gpt_config_from_hf, hf_config_from_gpt, infer_arch
from aligner.hf.weights import hf_to_megatron, lora_to_hf, megatron_to_hf
from aligner.models import lora as lora_adapters
from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
from aligner.runtime.distributed import ParallelConfig, initialize, shutdown
from aligner.runtime.errors import ConfigError, DataError, UserError
from aligner.runtime.files import read_json

HF_SOURCE_FILE = "hf_source.json"
# What an export writes besides the HF files (its checkpoint and options); it marks the directory as an
# export's, which a later export may replace.
EXPORT_RECORD_FILE = "aligner_export.json"
# The sibling an output is written into before it replaces the output (the checkpoints' convention).
_STAGING_SUFFIX = ".incomplete"
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


def is_hf_model_dir(path: str | os.PathLike) -> bool:
    """A Hugging Face model directory (config.json), not an aligner checkpoint (meta.json)."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / checkpointing.META_FILE).is_file()


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


def _refuse_output(output_dir: Path, inputs: Sequence[Path], record_file: str, overwrite: bool) -> None:
    """Refuse an output that is, holds or lies inside an input (even with `overwrite`: replacing it would
    delete the input), and a non-empty one that is not this command's earlier result (it holds `record_file`)
    unless `overwrite`."""
    output = output_dir.resolve()
    for source in inputs:
        source = Path(source).resolve()
        relation = ("is" if output == source else "lies inside" if source in output.parents
                    else "contains" if output in source.parents else None)
        if relation is not None:
            raise ConfigError(f"output {output_dir} {relation} the input {source}: writing it would destroy the input "
                              "(also with --overwrite); choose another output directory")
    if output_dir.exists() and not output_dir.is_dir():
        raise OutputError(f"output {output_dir} is a file; choose a directory")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not (output_dir / record_file).is_file() and not overwrite:
        raise OutputError(f"output directory {output_dir} is not empty and is not an earlier result of this command "
                          f"(it has no {record_file}): choose a new directory, or pass --overwrite to replace all of "
                          "its contents")


def _file_system_problem(error: BaseException) -> Optional[str]:
    """A failed write to the output in a few words (disk full, read-only, permission), or None if `error`
    is not one (a user error already reads as one line; a bug keeps its traceback)."""
    from safetensors import SafetensorError  # save_file's I/O errors are not OSErrors

    if checkpointing.is_disk_full(error):
        return "disk full (no space left on the device)"
    if isinstance(error, UserError) or not isinstance(error, (OSError, SafetensorError)):
        return None
    return getattr(error, "strerror", None) or str(error)


def _replace_directory(staging: Path, output_dir: Path) -> None:
    """Put the complete `staging` in the place of `output_dir` by renames; old contents are deleted only once
    the new ones are in place (a crash in between leaves them in `<output>.replaced`)."""
    if not (output_dir.is_dir() and any(output_dir.iterdir())):
        os.replace(staging, output_dir)  # onto nothing or an empty directory: one atomic rename
        return
    old = output_dir.with_name(output_dir.name + ".replaced")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(output_dir, old)
    try:
        os.replace(staging, output_dir)
    except BaseException:
        os.replace(old, output_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _staged_output(output_dir: str | os.PathLike, *, inputs: Sequence[Path], record_file: str,
                   overwrite: bool) -> Iterator[Path]:
    """The directory an import or export writes its output into: a sibling `<output>.incomplete` that
    replaces `output_dir` when the block ends without an error, and is removed when it fails or is
    interrupted, so the output is either the old one or the complete new one.

    The output is checked first (`_refuse_output`), before any work. A file-system failure while writing
    (disk full, read-only, permission) is one OutputError naming the output. Every rank enters it; rank 0
    does the file work (import's collective checkpoint save runs in between).
    """
    output_dir = Path(os.path.abspath(output_dir))  # also for ".": the staging directory is its sibling
    _refuse_output(output_dir, inputs, record_file, overwrite)
    staging = output_dir.with_name(output_dir.name + _STAGING_SUFFIX)
    try:
        if _is_rank_zero():
            shutil.rmtree(staging, ignore_errors=True)  # left by a killed earlier run
            staging.mkdir(parents=True)
        _barrier()
        yield staging
        _barrier()
        if _is_rank_zero():
            _replace_directory(staging, output_dir)
    except BaseException as error:  # also interrupts: nothing partial stays behind
        if _is_rank_zero():
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, checkpointing.CheckpointError) and str(staging) in str(error):
            # the checkpoint save's own one line (disk full with the sizes, ...), about the output
            raise OutputError(f"{str(error).replace(str(staging), str(output_dir))}; nothing was written") from error
        problem = _file_system_problem(error)
        if problem is not None:
            raise OutputError(f"cannot write {output_dir}: {problem}; nothing was written") from error
        raise
    _barrier()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def import_hf(
    hf_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    make_vocab_size_divisible_by: int = 128,
    overwrite: bool = False,
) -> Path:
    """Convert an HF model directory (an architecture of layout.ARCHS) into an aligner checkpoint at `output_dir`.

    The weights are held in float32 (lossless for bf16/fp16 sources); the tokenizer files are
    copied into the checkpoint. Runs at TP=1/PP=1 in this process; the result loads at any layout.
    `output_dir` must be new, empty or an earlier import's checkpoint, unless `overwrite`; never `hf_dir`.
    """
    hf_dir = Path(hf_dir)
    with _staged_output(output_dir, inputs=[hf_dir], record_file=HF_SOURCE_FILE, overwrite=overwrite) as staging:
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
            _write_imported_checkpoint(cfg, arch, hf_config, hf_state, staging,
                                       tokenizer_dir if has_tokenizer else None, source)
    return Path(output_dir)


def import_gguf(
    gguf_file: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    dtype: str = "float32",
    make_vocab_size_divisible_by: int = 128,
    overwrite: bool = False,
) -> Path:
    """Convert a GGUF file (dequantised to `dtype`: float32 | bfloat16) into an aligner checkpoint.

    The config (RoPE scaling included), tokenizer and chat template come from the file; then as `import_hf`.
    """
    torch_dtype(dtype)  # an unknown dtype fails before the file is read
    gguf_file = Path(gguf_file)
    with _staged_output(output_dir, inputs=[gguf_file], record_file=HF_SOURCE_FILE, overwrite=overwrite) as staging:
        with parsed_once(gguf_file):  # each read below would otherwise parse the file again
            config = read_gguf_config(gguf_file)
            hf_config = config.to_dict()
            cfg, arch = _model_config(hf_config, gguf_file, make_vocab_size_divisible_by)
            tokenizer = read_gguf_tokenizer(gguf_file)
            hf_state = read_gguf_state_dict(gguf_file, config, dtype)
        source = {"source_file": str(gguf_file.resolve()), "dtype": dtype, "generation_config": None}
        with tempfile.TemporaryDirectory() as scratch:
            tokenizer.save_pretrained(scratch)
            _write_imported_checkpoint(cfg, arch, hf_config, hf_state, staging, Path(scratch), source)
    return Path(output_dir)


def _write_imported_checkpoint(
    cfg: GPTConfig,
    arch: str,
    hf_config: dict,
    hf_state: dict[str, torch.Tensor],
    output_dir: Path,
    tokenizer_dir: Optional[Path],
    source: dict,
) -> None:
    """The one converter behind every import: HF-named weights -> TP=1 megatron model -> checkpoint in
    `output_dir` (the staging directory), plus `hf_source.json` (`source` and what export needs). Empties
    `hf_state` as it converts it."""
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
        _barrier()


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
PEFT_BASE_DIR = "base"  # a PEFT export's HF base, which its adapter_config.json names


def export_hf(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    arch: Optional[str] = None,
    dtype: Optional[str] = None,
    lora: str = "merge",
    base: Optional[str | os.PathLike] = None,
    base_model: Optional[str] = None,
    overwrite: bool = False,
) -> Path:
    """Write an aligner checkpoint as an HF model directory (config.json, model.safetensors, tokenizer).

    arch: one of layout.ARCHS; default: the imported source's, else inferred from the model.
    dtype: float32 | bfloat16 | float16; default: the imported source's, else float32.
    The checkpoint may have been saved at any TP/PP layout; it is loaded at TP=1/PP=1 here.
    A LoRA adapter checkpoint is loaded onto its base (`base`, default the path it recorded) and written
    either merged into the weights (lora="merge": a plain HF model) or as a PEFT adapter directory
    (lora="peft": adapter_config.json + adapter_model.safetensors, plus the HF export of the base in
    `<output>/base`, which adapter_config.json's base_model_name_or_path names by its absolute path, so
    `peft.AutoPeftModelForCausalLM.from_pretrained(output)` loads base and adapters in one call).
    base_model (lora="peft" only): name this HF model (a directory or a Hub id) as the base instead of writing
    `<output>/base`, e.g. the Hub model the base checkpoint was imported from, to publish the adapters alone.
    `output_dir` must be new, empty or an earlier export's directory (it holds aligner_export.json), unless
    `overwrite`; never the checkpoint or its base.
    """
    from safetensors.torch import save_file

    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    inputs = [checkpoint_dir, *([Path(base)] if base is not None else [])]
    _refuse_output(output_dir, inputs, EXPORT_RECORD_FILE, overwrite)  # before anything is read
    if lora not in LORA_EXPORTS:
        raise ConfigError(f"lora={lora!r}: choose one of {list(LORA_EXPORTS)}")
    meta = checkpointing.read_meta(checkpoint_dir)
    peft_meta = meta.get("peft")
    if peft_meta is None and (lora == "peft" or base is not None):
        raise ConfigError(f"{checkpoint_dir} is a whole model, not LoRA adapters: --lora peft and --base apply to "
                          "adapter checkpoints")
    if base_model is not None and lora != "peft":
        raise ConfigError("--base-model names the HF base of a PEFT adapter export: it needs --lora peft")
    if base_model is not None and os.path.exists(base_model) and not is_hf_model_dir(base_model):
        raise ConfigError(f"--base-model {base_model} is not a Hugging Face model directory (no config.json); "
                          "give one, or a Hub model id")
    base_dir = lora_adapters.adapter_base(checkpoint_dir, peft_meta, base) if peft_meta is not None else None
    cfg = GPTConfig.from_dict(meta["model"])
    source = read_hf_source(checkpoint_dir) or (read_hf_source(base_dir) if base_dir is not None else {})
    arch = arch or source.get("arch") or infer_arch(cfg)
    dtype = dtype or source.get("dtype") or "float32"
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported for export; choose one of {sorted(_DTYPES)}")
    hf_config = hf_config_from_gpt(cfg, arch, dtype=dtype, **_special_token_ids(checkpoint_dir, source))
    record = {"checkpoint": str(checkpoint_dir.resolve()), "arch": arch, "dtype": dtype,
              "base": None if base_dir is None else str(base_dir.resolve()), "lora": None if base_dir is None else lora}
    if lora == "peft":
        record["base_model"] = base_model or str(output_dir.resolve() / PEFT_BASE_DIR)

    inputs += [base_dir] if base_dir is not None else []
    with _staged_output(output_dir, inputs=inputs, record_file=EXPORT_RECORD_FILE, overwrite=overwrite) as staging:
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
        # the merged model, or (PEFT) the base the adapters go onto: the same weights without them
        hf_state = {name: t.to(_DTYPES[dtype]) for name, t in megatron_to_hf(megatron_state, cfg, arch).items()}
        if lora == "peft":
            hf_adapters = lora_to_hf(adapters, cfg, arch)
            adapter_state = {f"base_model.model.{module}.lora_{part}.weight": tensor.to(_DTYPES[dtype])
                             for module, pair in hf_adapters.items() for part, tensor in zip("AB", pair)}
            adapter_config = {
                "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": peft_meta["rank"], "lora_alpha": peft_meta["alpha"],
                "lora_dropout": peft_meta["dropout"], "bias": "none", "use_rslora": False,
                "fan_in_fan_out": arch == "gpt2",
                # the modules' last two name parts: GPT-2 has a c_proj in attention and in the MLP
                "target_modules": sorted({".".join(module.split(".")[-2:]) for module in hf_adapters}),
                "base_model_name_or_path": record["base_model"], "inference_mode": True,
            }

        if _is_rank_zero():
            tokenizer_dir = checkpoint_dir / checkpointing.TOKENIZER_DIR
            if lora == "peft":
                (staging / ADAPTER_CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2, sort_keys=True))
                save_file(adapter_state, str(staging / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
                _copy_files(tokenizer_dir, staging)
                if base_model is None:
                    (staging / PEFT_BASE_DIR).mkdir()
                    _write_hf_model(staging / PEFT_BASE_DIR, hf_config, hf_state, source, tokenizer_dir)
            else:
                _write_hf_model(staging, hf_config, hf_state, source, tokenizer_dir)
            (staging / EXPORT_RECORD_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))
    return output_dir


def _copy_files(source: Path, target: Path) -> None:
    """The files (not directories) of `source`, if it exists, into `target`."""
    if source.is_dir():
        for path in source.iterdir():
            if path.is_file():
                shutil.copy2(path, target / path.name)


def _write_hf_model(directory: Path, hf_config, hf_state: dict[str, torch.Tensor], source: dict,
                    tokenizer_dir: Path) -> None:
    """An HF model directory: config.json, model.safetensors, the source's generation config, the tokenizer."""
    from safetensors.torch import save_file

    hf_config.save_pretrained(str(directory))
    save_file(hf_state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if source.get("generation_config"):
        (directory / "generation_config.json").write_text(json.dumps(source["generation_config"], indent=2))
    _copy_files(tokenizer_dir, directory)
