"""REINFORCE / RLOO actor: k samples per prompt, leave-one-out baseline, no critic (megatron TP/PP/DP).

    torchrun --nproc_per_node N examples/nlp/gpt/train_gpt_reinforce_actor.py model.init_from=SFT_CHECKPOINT \
        data.prompts=prompts.jsonl reward.source=function reward.function=package.module:function [key=value ...]

With reward.source=server a reward-model server (serve_reward_model.py) must be up; see
conf/gpt_reinforce_actor.yaml for every key.
"""
from aligner.algorithms.reinforce import ReinforceConfig, build_reinforce_trainer
from aligner.config import CONF_DIR, load_config, parse_command_line, run_main


def main() -> None:
    config_path, overrides = parse_command_line(CONF_DIR / "gpt_reinforce_actor.yaml")
    cfg = load_config(ReinforceConfig, config_path, overrides)
    trainer = build_reinforce_trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.metrics.close()


if __name__ == "__main__":
    run_main(main)
