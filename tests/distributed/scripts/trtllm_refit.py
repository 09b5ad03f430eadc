"""Rank r's TensorRT-LLM weights from its TP=2 megatron shard (`local_rank_weights`, the refit path)
against rank r of the full conversion of the same weights.

    torchrun --nproc_per_node 2 trtllm_refit.py WORK_DIR   # rank 0 prints RESULT {json}
"""
import json
import sys
from pathlib import Path

import torch.distributed as dist

from aligner import checkpointing
from aligner.generation.trtllm import local_rank_weights, megatron_to_trtllm_checkpoint
from aligner.models.gpt import build_gpt_model, transformer_config
from aligner.runtime.distributed import ParallelConfig, initialize, shutdown
from aligner.runtime.seeds import set_seed
from tests.unit.test_trtllm_conversion import gpt2_cfg, llama_cfg


def main(work: Path) -> None:
    """Rank r's weights from its TP=2 megatron shard == rank r of the full conversion (same weights)."""
    result = {}
    for arch, cfg in (("llama", llama_cfg(make_vocab_size_divisible_by=16)), ("gpt2", gpt2_cfg())):
        initialize(ParallelConfig(tensor_model_parallel_size=2))
        set_seed(11)
        model = build_gpt_model(cfg, transformer_config(cfg, tensor_parallel_size=2))
        local = local_rank_weights([model], cfg, arch)
        checkpointing.save(work / arch, [model], model_config=cfg.to_dict())
        initialize(ParallelConfig())  # TP=1 x DP=2: the full model from the checkpoint saved at TP=2
        full_model = build_gpt_model(cfg, transformer_config(cfg))
        checkpointing.load(work / arch, [full_model])
        _, expected = megatron_to_trtllm_checkpoint(full_model.state_dict(), cfg, 2, arch)
        mine = expected[dist.get_rank()]
        names_equal = set(mine) == set(local)
        diff = max((mine[n] - local[n]).abs().max().item() for n in mine) if names_equal else -1.0
        gathered = [None, None]
        dist.all_gather_object(gathered, (names_equal, diff))
        result[arch] = {"names_equal": [g[0] for g in gathered], "max_diff": [g[1] for g in gathered]}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
