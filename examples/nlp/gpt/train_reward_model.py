"""Reward-model training: binary ranking (Bradley-Terry) or attribute regression (SteerLM).

    torchrun --nproc_per_node N examples/nlp/gpt/train_reward_model.py model.init_from=SFT_CKPT \\
        'data.train=[{path: comparisons.jsonl}]' [key=value ...]
"""
from aligner.algorithms.reward_model import RewardModelConfig, build_reward_model_trainer, finish_reward_model
from aligner.config import CONF_DIR, load_config, parse_command_line, run_main


def main() -> None:
    config_path, overrides = parse_command_line(CONF_DIR / "training_rm.yaml")
    cfg = load_config(RewardModelConfig, config_path, overrides)
    trainer = build_reward_model_trainer(cfg)
    try:
        trainer.fit()
        finish_reward_model(trainer, cfg)
    finally:
        trainer.metrics.close()


if __name__ == "__main__":
    run_main(main)
