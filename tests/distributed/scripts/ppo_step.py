"""One PPO step through `build_rl_actor` at the layout given on the command line; rank 0 writes the
step's metrics as JSON. The reward (digits in the response) and a critic that predicts 0 everywhere run
in process: this checks the actor's own computation (rollout, logprobs, minibatch updates), not the servers.

    torchrun --nproc_per_node N ppo_step.py OUTPUT_JSON key=value ...
"""
import json
import sys

import torch.distributed as dist

from aligner.algorithms.rl_build import build_rl_actor
from aligner.algorithms.rl_config import RLActorConfig
from aligner.config import CONF_DIR, load_config
from aligner.generation.rewards import Scores
from tests.null_critic import NullCritic, done


class DigitReward:
    def score_async(self, sequences, prompts, response_texts, records, columns=None):
        return done(Scores.of([float(sum(c.isdigit() for c in text)) for text in response_texts]))


def main() -> None:
    output, overrides = sys.argv[1], sys.argv[2:]
    cfg = load_config(RLActorConfig, CONF_DIR / "gpt_ppo_actor.yaml", overrides)
    trainer = build_rl_actor(cfg, critic=NullCritic(), reward_source=DigitReward())
    metrics = trainer.train_step()
    trainer.rollouts.router.close()
    if dist.get_rank() == 0:
        with open(output, "w") as handle:
            json.dump(metrics, handle)


if __name__ == "__main__":
    main()
