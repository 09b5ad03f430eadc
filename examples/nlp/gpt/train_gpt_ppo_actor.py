"""PPO actor: generation, scoring through the reward/critic servers, PPO updates (megatron TP/PP/DP).

    torchrun --nproc_per_node N examples/nlp/gpt/train_gpt_ppo_actor.py model.init_from=SFT_CHECKPOINT \
        data.prompts=prompts.jsonl [key=value ...]

The RL actor with aligner/conf/gpt_ppo_actor.yaml (advantage.estimator=gae: the critic server's values).
The critic server (serve_ppo_critic.py) and the reward source must be up; examples/nlp/gpt/launch_ppo.py
starts everything on one machine.
"""
from aligner.algorithms.rl_build import build_rl_actor
from aligner.algorithms.rl_config import RLActorConfig
from aligner.config import run_main
from aligner.training.run import run_training

if __name__ == "__main__":
    run_main(lambda: run_training(RLActorConfig, "gpt_ppo_actor.yaml", build_rl_actor))
