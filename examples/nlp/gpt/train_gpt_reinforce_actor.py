"""Group-baseline RL actor, no critic: RLOO, GRPO, Dr. GRPO, DAPO, GSPO, CISPO, REINFORCE++ (megatron TP/PP/DP).

    torchrun --nproc_per_node N examples/nlp/gpt/train_gpt_reinforce_actor.py model.init_from=SFT_CHECKPOINT \
        data.prompts=prompts.jsonl reward.source=function reward.function=myreward.py:function \
        [algorithm=grpo|dapo|gspo|cispo|rloo|reinforce_plus_plus|dr_grpo] [key=value ...]

The RL actor with aligner/conf/gpt_reinforce_actor.yaml (RLOO by default; `algorithm=NAME` sets a preset,
docs/algorithms/rl.md lists each algorithm's settings; algorithm=ppo: train_gpt_ppo_actor.py). With
reward.source=server a reward-model server (serve_reward_model.py) must be up.
"""
from aligner.algorithms.rl_build import build_rl_actor
from aligner.algorithms.rl_config import GroupRLActorConfig
from aligner.config import run_main
from aligner.training.run import run_training

if __name__ == "__main__":
    run_main(lambda: run_training(GroupRLActorConfig, "gpt_reinforce_actor.yaml", build_rl_actor))
