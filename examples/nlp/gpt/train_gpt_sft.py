"""Supervised fine-tuning of a GPT model.

    torchrun --nproc_per_node N examples/nlp/gpt/train_gpt_sft.py [--config conf/gpt_sft.yaml] key=value ...
"""
from aligner.algorithms.sft import SFTConfig, build_sft_trainer
from aligner.config import CONF_DIR, load_config, parse_command_line, run_main


def main() -> None:
    config_path, overrides = parse_command_line(CONF_DIR / "gpt_sft.yaml")
    cfg = load_config(SFTConfig, config_path, overrides)
    trainer = build_sft_trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.metrics.close()


if __name__ == "__main__":
    run_main(main)
