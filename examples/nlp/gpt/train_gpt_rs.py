"""Rejection sampling (best-of-n): sample n answers per prompt, score them, fine-tune on the best; iterate.

    torchrun --nproc_per_node N examples/nlp/gpt/train_gpt_rs.py model.init_from=SFT_CKPT data.prompts=prompts.jsonl \\
        reward.source=function reward.function=my_module:score [rs.samples_per_prompt=8 rs.num_iterations=3 ...]
"""
from aligner.algorithms.rejection_sampling import RSConfig, build_rs_run
from aligner.config import run_main
from aligner.training.run import run_training

if __name__ == "__main__":
    run_main(lambda: run_training(RSConfig, "gpt_rs.yaml", build_rs_run))
