"""Self-play fine-tuning (SPIN) of a GPT policy on SFT demonstrations.

    torchrun --nproc_per_node N examples/nlp/gpt/train_gpt_spin.py model.init_from=SFT_CKPT \\
        'data.train=[{path: sft.jsonl}]' spin.num_iterations=2 'spin.kl_betas=[0.1, 0.05]' [key=value ...]
"""
from aligner.algorithms.spin import SPINConfig, build_spin_run
from aligner.config import run_main
from aligner.training.run import run_training

if __name__ == "__main__":
    run_main(lambda: run_training(SPINConfig, "gpt_spin.yaml", build_spin_run))
