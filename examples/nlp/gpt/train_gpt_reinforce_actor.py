"""REINFORCE / RLOO actor: k samples per prompt, leave-one-out baseline, no critic (megatron TP/PP/DP).

    torchrun --nproc_per_node N examples/nlp/gpt/train_gpt_reinforce_actor.py model.init_from=SFT_CHECKPOINT \
        data.prompts=prompts.jsonl reward.source=function reward.function=package.module:function [key=value ...]

With reward.source=server a reward-model server (serve_reward_model.py) must be up; see
conf/gpt_reinforce_actor.yaml for every key.
"""
from aligner.algorithms.reinforce import ReinforceConfig, build_reinforce_trainer
from aligner.config import run_main, run_training

if __name__ == "__main__":
    run_main(lambda: run_training(ReinforceConfig, "gpt_reinforce_actor.yaml", build_reinforce_trainer))
