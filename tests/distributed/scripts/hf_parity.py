"""HF import/export checks under torchrun (see tests/distributed/test_hf_parity.py).

Work directory layout, per architecture: <work>/<arch>/hf (HF model written by the test),
<arch>/reference.pt (tokens and transformers' logits), <arch>/ckpt (imported checkpoint),
<arch>/export (exported HF model), <arch>/ckpt_tp2 (the checkpoint re-saved at TP=2).

Modes (rank 0 prints one `RESULT <json>` line):
  tp1 WORK ARCH...  (1 process) import each model, compare megatron logits at TP=1 with
                    transformers', export it to <arch>/export
  parallel WORK     (2 processes) import llama and gpt2 at TP=1 x DP=2, compare logits at TP=2
                    (llama, gpt2) and PP=2 (llama, gpt2 with its tied embeddings split across stages), re-save llama at TP=2 to llama/ckpt_tp2
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from aligner import checkpointing
from aligner.hf import export_hf, import_hf
from aligner.models.forward import forward_logits
from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
from aligner.runtime.distributed import ParallelConfig, initialize, shutdown
from aligner.runtime.seeds import set_seed


def megatron_logit_diff(checkpoint: Path, reference_file: Path, tp: int, pp: int, resave: Path = None) -> float:
    """Max |megatron logits - transformers logits| with the checkpoint loaded at TP=tp, PP=pp."""
    initialize(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))
    set_seed(0)
    meta = checkpointing.read_meta(checkpoint)
    cfg = GPTConfig.from_dict(meta["model"])
    model = build_gpt_model(cfg, transformer_config(cfg, tensor_parallel_size=tp, pipeline_parallel_size=pp))
    checkpointing.load(checkpoint, [model])
    reference = torch.load(reference_file)
    logits = forward_logits([model], reference["tokens"], cfg.vocab_size)
    if resave is not None:
        checkpointing.save(resave, [model], model_config=meta["model"],
                           tokenizer_dir=checkpoint / checkpointing.TOKENIZER_DIR)
    # Every rank holds the logits (the last stage broadcasts them): the worst rank counts.
    diff = (logits - reference["logits"]).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def main() -> None:
    mode, work, archs = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    result = {}
    if mode == "tp1":
        initialize(ParallelConfig())
        for arch in archs:
            import_hf(work / arch / "hf", work / arch / "ckpt")
            result[arch] = megatron_logit_diff(work / arch / "ckpt", work / arch / "reference.pt", 1, 1)
            export_hf(work / arch / "ckpt", work / arch / "export")
    elif mode == "parallel":
        initialize(ParallelConfig())  # TP=1 x DP=2: every rank converts, the save deduplicates
        for arch in ("llama", "gpt2"):
            import_hf(work / arch / "hf", work / arch / "ckpt")
        for arch, tp, pp in (("llama", 2, 1), ("gpt2", 2, 1), ("llama", 1, 2), ("gpt2", 1, 2)):
            resave = work / arch / "ckpt_tp2" if (arch, tp) == ("llama", 2) else None
            diff = megatron_logit_diff(work / arch / "ckpt", work / arch / "reference.pt", tp, pp, resave)
            result[f"{arch}/tp{tp}pp{pp}"] = diff
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    shutdown()


if __name__ == "__main__":
    main()
