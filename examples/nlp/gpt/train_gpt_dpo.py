"""Direct preference optimisation (DPO, IPO, RPO, conservative DPO) of a GPT policy.

    torchrun --nproc_per_node N examples/nlp/gpt/train_gpt_dpo.py model.init_from=SFT_CKPT \\
        'data.train=[{path: preferences.jsonl}]' [dpo.beta=0.1 dpo.preference_loss=dpo ...]
"""
from aligner.algorithms.dpo import DPOConfig, build_dpo_trainer
from aligner.config import CONF_DIR, load_config, parse_command_line, run_main


def main() -> None:
    config_path, overrides = parse_command_line(CONF_DIR / "gpt_dpo.yaml")
    cfg = load_config(DPOConfig, config_path, overrides)
    trainer = build_dpo_trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.metrics.close()


if __name__ == "__main__":
    run_main(main)
