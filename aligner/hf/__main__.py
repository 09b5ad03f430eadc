"""CLI for HF import/export.

    python -m aligner.hf import --hf-dir HF_MODEL_DIR --output CHECKPOINT_DIR [--make-vocab-size-divisible-by 128]
    python -m aligner.hf import --gguf FILE.gguf --output CHECKPOINT_DIR [--dtype float32|bfloat16]
    python -m aligner.hf export --checkpoint CHECKPOINT_OR_RUN_DIR --output HF_DIR [--arch llama] [--dtype bfloat16]
    python -m aligner.hf export --checkpoint LORA_CHECKPOINT --output DIR [--lora merge|peft] [--base BASE_CHECKPOINT]
        [--base-model HF_DIR_OR_HUB_ID]   (--lora peft: the base adapter_config.json names; default OUTPUT/base)
    (either command: [--overwrite])

Both run in one process at TP=1/PP=1; the imported checkpoint loads at any TP/PP layout, and a
checkpoint saved at any layout can be exported. A LoRA adapter checkpoint exports merged into its
base's weights (a plain HF model) or as a PEFT adapter directory for the HF export of its base. A GGUF
file is dequantised (float32 keeps the values exactly); its tokenizer and chat template go into the
checkpoint. The output is written into a sibling `<output>.incomplete` and renamed into place when
complete; a non-empty output that is not the same command's earlier result is refused unless
--overwrite, and an output that is (or holds, or lies inside) an input always. User errors end with
one line `error: ...` and exit status 2.
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from aligner.config import run_main
from aligner.hf.convert import export_hf, import_gguf, import_hf
from aligner.hf.layout import ARCHS
from aligner.hf.sources import is_run_directory, resolve_model_source
from aligner.runtime.errors import ConfigError


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m aligner.hf", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    to_aligner = commands.add_parser("import", help="HF model directory or GGUF file -> aligner checkpoint")
    source = to_aligner.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-dir", help="directory with config.json, weights and tokenizer files")
    source.add_argument("--gguf", help="a .gguf file (needs the gguf extra: pip install 'aligner[gguf]')")
    to_aligner.add_argument("--output", required=True,
                            help="checkpoint directory to write: new, empty, or an earlier import's checkpoint")
    to_aligner.add_argument(
        "--make-vocab-size-divisible-by", type=int, default=128,
        help="pad the vocabulary to a multiple of this (must be divisible by every TP size you will use)",
    )
    to_aligner.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                            help="--gguf only: precision of the dequantised weights, and the default export dtype "
                                 "(default float32, which keeps the values exactly)")

    to_hf = commands.add_parser("export", help="aligner checkpoint -> HF model directory")
    to_hf.add_argument("--checkpoint", required=True,
                       help="aligner checkpoint directory (any TP/PP layout), or a run directory (its latest intact "
                            "checkpoint)")
    to_hf.add_argument("--output", required=True,
                       help="directory for the HF model: new, empty, or an earlier export's directory")
    to_hf.add_argument("--arch", choices=ARCHS, default=None, help="default: the imported model's, else inferred")
    to_hf.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                       help="default: the imported model's, else float32")
    to_hf.add_argument("--lora", choices=("merge", "peft"), default="merge",
                       help="a LoRA adapter checkpoint: merge the adapters into the weights (default), or write a "
                            "PEFT adapter directory (adapter_config.json + adapter_model.safetensors)")
    to_hf.add_argument("--base", default=None,
                       help="a LoRA adapter checkpoint's base checkpoint (default: the path it recorded)")
    to_hf.add_argument("--base-model", default=None,
                       help="--lora peft: the HF model (directory or Hub id) adapter_config.json names as the base, "
                            "instead of the HF export of the base written to OUTPUT/base (the default, which "
                            "AutoPeftModelForCausalLM.from_pretrained(OUTPUT) loads)")
    for command in (to_aligner, to_hf):
        command.add_argument("--overwrite", action="store_true",
                             help="replace a non-empty --output that is not an earlier result of this command "
                                  "(never an input)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    if args.command == "import" and args.gguf:
        path = import_gguf(args.gguf, args.output, dtype=args.dtype or "float32",
                           make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, overwrite=args.overwrite)
        print(f"imported {args.gguf} -> {path}")
    elif args.command == "import":
        if args.dtype is not None:
            raise ConfigError("--dtype applies to --gguf only; an HF directory keeps its weights' own dtype")
        path = import_hf(args.hf_dir, args.output, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                         overwrite=args.overwrite)
        print(f"imported {args.hf_dir} -> {path}")
    else:
        checkpoint = args.checkpoint
        if is_run_directory(checkpoint):  # its latest intact checkpoint; any other path is export_hf's to judge
            checkpoint = resolve_model_source(checkpoint, "--checkpoint", print)
        path = export_hf(checkpoint, args.output, arch=args.arch, dtype=args.dtype, lora=args.lora, base=args.base,
                         base_model=args.base_model, overwrite=args.overwrite)
        print(f"exported {checkpoint} -> {path}")


if __name__ == "__main__":  # dist_checkpointing spawns worker processes that re-import __main__
    run_main(main)
