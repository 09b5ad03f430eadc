"""Supervised fine-tuning of a GPT model.

    torchrun --nproc_per_node N examples/nlp/gpt/train_gpt_sft.py [--config aligner/conf/gpt_sft.yaml] key=value ...
"""
from aligner.algorithms.sft import SFTConfig, build_sft_trainer
from aligner.config import run_main
from aligner.training.run import run_training

if __name__ == "__main__":
    run_main(lambda: run_training(SFTConfig, "gpt_sft.yaml", build_sft_trainer))
