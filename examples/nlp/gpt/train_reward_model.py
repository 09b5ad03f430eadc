"""Reward-model training: binary ranking (Bradley-Terry) or attribute regression (SteerLM).

    torchrun --nproc_per_node N examples/nlp/gpt/train_reward_model.py model.init_from=SFT_CKPT \\
        'data.train=[{path: comparisons.jsonl}]' [key=value ...]
"""
from aligner.algorithms.reward_model import (
    RewardModelConfig,
    build_reward_model_trainer,
    finish_reward_model,
    serve_command,
)
from aligner.config import run_main
from aligner.training.run import run_training

if __name__ == "__main__":
    run_main(lambda: run_training(RewardModelConfig, "training_rm.yaml", build_reward_model_trainer,
                                  after_fit=finish_reward_model, next_commands=serve_command))
