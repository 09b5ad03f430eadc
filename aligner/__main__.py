"""The training entry points of an installed aligner (a wheel has no examples/): `python -m aligner NAME
[--config PATH] [key=value ...]`, or the `aligner` console script. Each runs as examples/nlp/gpt/'s script of
the same method, with the shipped yaml (aligner/conf/) as its default config:

    python -m aligner sft 'data.train=[{path: sft.jsonl}]' checkpoint.save_dir=results/sft
"""
from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

from aligner.algorithms.distillation import KDConfig, build_kd_trainer
from aligner.algorithms.dpo import DPOConfig, build_dpo_trainer
from aligner.algorithms.kto import KTOConfig, build_kto_trainer
from aligner.algorithms.rejection_sampling import RSConfig, build_rs_run
from aligner.algorithms.reward_model import (
    RewardModelConfig,
    build_reward_model_trainer,
    finish_reward_model,
    serve_command,
)
from aligner.algorithms.rl_build import build_rl_actor
from aligner.algorithms.rl_config import GroupRLActorConfig, RLActorConfig
from aligner.algorithms.sft import SFTConfig, build_sft_trainer
from aligner.algorithms.spin import SPINConfig, build_spin_run
from aligner.config import ConfigError, run_main
from aligner.training.run import run_training

# NAME -> the body of its entry point, given the command line after NAME (as examples/nlp/gpt/train_*.py)
ENTRY_POINTS: dict[str, Callable[[Sequence[str]], None]] = {
    "sft": lambda argv: run_training(SFTConfig, "gpt_sft.yaml", build_sft_trainer, argv=argv),
    "reward_model": lambda argv: run_training(RewardModelConfig, "training_rm.yaml", build_reward_model_trainer,
                                              after_fit=finish_reward_model, next_commands=serve_command,
                                              argv=argv),
    "dpo": lambda argv: run_training(DPOConfig, "gpt_dpo.yaml", build_dpo_trainer, argv=argv),
    "kto": lambda argv: run_training(KTOConfig, "gpt_kto.yaml", build_kto_trainer, argv=argv),
    "spin": lambda argv: run_training(SPINConfig, "gpt_spin.yaml", build_spin_run, argv=argv),
    "rs": lambda argv: run_training(RSConfig, "gpt_rs.yaml", build_rs_run, argv=argv),
    "knowledge_distillation": lambda argv: run_training(KDConfig, "gpt_knowledge_distillation.yaml",
                                                        build_kd_trainer, argv=argv),
    "ppo_actor": lambda argv: run_training(RLActorConfig, "gpt_ppo_actor.yaml", build_rl_actor, argv=argv),
    "reinforce_actor": lambda argv: run_training(GroupRLActorConfig, "gpt_reinforce_actor.yaml", build_rl_actor,
                                                 argv=argv),
}


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)

    def run() -> None:
        if not argv or argv[0] not in ENTRY_POINTS:
            given = f"got {argv[0]!r}" if argv else "got none"
            raise ConfigError(f"usage: python -m aligner NAME [--config PATH] [key=value ...]; NAME is one of "
                              f"{', '.join(ENTRY_POINTS)} ({given})")
        ENTRY_POINTS[argv[0]](argv[1:])

    run_main(run)


if __name__ == "__main__":
    main()
