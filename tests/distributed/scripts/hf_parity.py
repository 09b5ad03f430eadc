"""HF import/export checks under torchrun (see tests/distributed/test_hf_parity.py).

Work directory layout, per model family (a directory name, e.g. llama3_tied; the HF architecture is
in its config): <work>/<family>/hf (HF model written by the test), <family>/reference.pt (tokens
and transformers' logits), <family>/ckpt (imported checkpoint), <family>/export (exported HF
model), <family>/ckpt_<layout> (the checkpoint re-saved at that layout, when asked for).

Modes (rank 0 prints one `RESULT <json>` line):
  tp1 WORK FAMILY...       (1 process) import each model, compare megatron logits at TP=1 with
                           transformers', export it to <family>/export
  parallel WORK FAMILY...  (2 processes) import every model at TP=1 x DP=2, compare logits at
                           TP=2 and PP=2 (tied embeddings split across stages), and at EP=2 for MoE
                           models; re-save the first dense family at TP=2 and the first MoE family
                           at EP=2 (ckpt_tp2, ckpt_ep2)
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


def megatron_logit_diff(checkpoint: Path, reference_file: Path, tp: int, pp: int, ep: int = 1,
                        resave: Path = None) -> float:
    """Max |megatron logits - transformers logits| with the checkpoint loaded at TP=tp, PP=pp, EP=ep."""
    initialize(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              expert_model_parallel_size=ep))
    set_seed(0)
    meta = checkpointing.read_meta(checkpoint)
    cfg = GPTConfig.from_dict(meta["model"])
    config = transformer_config(cfg, tensor_parallel_size=tp, pipeline_parallel_size=pp, expert_parallel_size=ep)
    model = build_gpt_model(cfg, config).eval()
    checkpointing.load(checkpoint, [model])
    reference = torch.load(reference_file)
    logits = forward_logits([model], reference["tokens"], cfg.vocab_size)
    if cfg.is_moe:  # each rank holds its share of the experts
        local_experts = model.decoder.layers[-1].mlp.experts.local_experts
        assert len(local_experts) == cfg.num_moe_experts // ep, (len(local_experts), ep)
    if ep > 1:  # generation at EP>1 is refused with a reason (see aligner/generation/native/engine.py)
        from aligner.config import ConfigError
        from aligner.generation.native import NativeEngine

        try:
            NativeEngine([model], cfg, pad_id=0, eos_id=2, max_batch_size=1, max_sequence_length=8)
        except ConfigError as error:
            assert "expert_model_parallel_size=2" in str(error), error
        else:
            raise AssertionError("NativeEngine accepted an expert-parallel MoE model")
    if resave is not None:
        checkpointing.save(resave, [model], model_config=meta["model"],
                           tokenizer_dir=checkpoint / checkpointing.TOKENIZER_DIR)
    # Every rank holds the logits (the last stage broadcasts them): the worst rank counts.
    diff = (logits - reference["logits"]).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def main() -> None:
    mode, work, families = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    result = {}
    if mode == "tp1":
        initialize(ParallelConfig())
        for family in families:
            import_hf(work / family / "hf", work / family / "ckpt")
            result[family] = megatron_logit_diff(work / family / "ckpt", work / family / "reference.pt", 1, 1)
            export_hf(work / family / "ckpt", work / family / "export")
    elif mode == "parallel":
        initialize(ParallelConfig())  # TP=1 x DP=2: every rank converts, the save deduplicates
        for family in families:
            import_hf(work / family / "hf", work / family / "ckpt")
        is_moe = {family: GPTConfig.from_dict(checkpointing.read_meta(work / family / "ckpt")["model"]).is_moe
                  for family in families}
        resaved = {("tp2", next(f for f in families if not is_moe[f])),
                   ("ep2", next((f for f in families if is_moe[f]), None))}
        for family in families:
            layouts = [("tp2", 2, 1, 1), ("pp2", 1, 2, 1)] + ([("ep2", 1, 1, 2)] if is_moe[family] else [])
            for name, tp, pp, ep in layouts:
                resave = work / family / f"ckpt_{name}" if (name, family) in resaved else None
                diff = megatron_logit_diff(work / family / "ckpt", work / family / "reference.pt", tp, pp, ep, resave)
                result[f"{family}/{name}"] = diff
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    shutdown()


if __name__ == "__main__":
    main()
