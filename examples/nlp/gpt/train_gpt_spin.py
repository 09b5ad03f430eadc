"""Self-play fine-tuning (SPIN) of a GPT policy on SFT demonstrations.

    torchrun --nproc_per_node N examples/nlp/gpt/train_gpt_spin.py model.init_from=SFT_CKPT \\
        'data.train=[{path: sft.jsonl}]' spin.num_iterations=2 'spin.kl_betas=[0.1, 0.05]' [key=value ...]
"""
from aligner.algorithms.spin import SPINConfig, build_spin_run
from aligner.config import CONF_DIR, load_config, parse_command_line, run_main


def main() -> None:
    config_path, overrides = parse_command_line(CONF_DIR / "gpt_spin.yaml")
    cfg = load_config(SPINConfig, config_path, overrides)
    run = build_spin_run(cfg)
    try:
        run.fit()
    finally:
        run.trainer.metrics.close()


if __name__ == "__main__":
    run_main(main)
