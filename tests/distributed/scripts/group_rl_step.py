"""The group-baseline RL actor (`build_rl_actor` on aligner/conf/gpt_reinforce_actor.yaml) at the layout given on
the command line, with an in-process reward (the fraction of the response's characters that are the digit "1").

    torchrun --nproc_per_node N group_rl_step.py step OUTPUT_JSON key=value ...   # one step; rank 0 writes
        the step's metrics and every rollout's prompt, response, score, reward and advantage, gathered over
        data-parallel ranks
    torchrun --nproc_per_node N group_rl_step.py fit OUTPUT_JSON key=value ...    # trainer.fit(); rank 0 writes
        the per-step metrics
"""
import json
import sys
from concurrent.futures import Future

import torch.distributed as dist

from aligner.algorithms.rl_build import build_rl_actor
from aligner.algorithms.rl_config import RLActorConfig
from aligner.config import CONF_DIR, load_config
from aligner.generation.rewards import Scores


def ones_fraction(response_text: str) -> float:
    return sum(c == "1" for c in response_text) / max(len(response_text), 1)


class OnesReward:
    def score_async(self, sequences, prompts, response_texts, records, columns=None):
        future: Future = Future()
        future.set_result(Scores.of([ones_fraction(text) for text in response_texts]))
        return future


def main() -> None:
    mode, output, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    cfg = load_config(RLActorConfig, CONF_DIR / "gpt_reinforce_actor.yaml", overrides)
    trainer = build_rl_actor(cfg, reward_source=OnesReward())
    if mode == "fit":
        steps = []
        log = trainer.metrics.log
        trainer.metrics.log = lambda step, metrics, prefix="train": (steps.append({"split": prefix, **metrics}),
                                                                      log(step, metrics, prefix))
        trainer.fit()
        result = steps
    else:
        captured = {}
        make_experience = trainer.make_experience

        def capture(batch, old_logprobs, reference_logprobs):
            experience = make_experience(batch, old_logprobs, reference_logprobs)
            captured.update({index: {"prompt": batch.rows[b].prompt, "response": batch.rows[b].response.tolist(),
                                     "score": batch.rows[b].score, "advantage": float(experience.advantages[b, 0]),
                                     "reward": float(experience.sequence_rewards[b])}
                             for b, index in enumerate(batch.indices)})
            return experience

        trainer.make_experience = capture
        metrics = trainer.train_step()
        trainer.rollouts.close()
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, captured)
        rows = {}
        for part in parts:  # TP/PP ranks of a replica hold the same rows
            rows.update(part)
        result = {"metrics": metrics, "rows": {str(k): v for k, v in sorted(rows.items())}}
    if dist.get_rank() == 0:
        with open(output, "w") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main()
