"""Our trainer for a `Workload`, built as its entry point builds it, and one step of it as `fit` runs it.

Shared by the worker of the TRL comparison (aligner_worker.py) and the benchmarks that run one trainer with a
setting alternated step by step (shared_prompts.py, output_layer_positions.py), so all of them time the same
step. Runs in the project's venv with benchmarks/ on sys.path.
"""
from __future__ import annotations

import contextlib
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from peer.workload import RL_TASKS, Workload, aligner_overrides, default_workload, write_data


@dataclass
class OurTrainer:
    task: str
    trainer: Any  # the RL actor, or the SFT / DPO trainer
    config: Any  # its loaded config (the `packing` section is config.packing)
    step: Callable[[], dict[str, float]]  # one step; its metrics, with "seconds" (wall time of the whole step)
    close: Callable[[], None]

    @property
    def objective(self):
        return self.trainer.objective


def build_ours(work: Workload, checkpoint_dir: Path, data: Path, scratch: Path) -> OurTrainer:
    """Our trainer of `work.task` from its conf yaml and `aligner_overrides`. A step: the RL actor collects,
    scores and trains on one rollout batch; SFT/DPO fetch the next batch inside the step (as `fit` does: DPO's
    swapped-in reference pass is part of it) and add "sequence_tokens", the step's sequences' real tokens as
    TRL counts them (the trainer's own count takes a shared prompt once)."""
    from aligner.config import CONF_DIR, load_config

    yaml_name, overrides = aligner_overrides(work, checkpoint_dir, data, scratch)
    if work.task in RL_TASKS:
        from aligner.algorithms.rl_build import build_rl_actor
        from aligner.algorithms.rl_config import RLActorConfig

        config = load_config(RLActorConfig, CONF_DIR / yaml_name, overrides)
        actor = build_rl_actor(config)

        def rl_step() -> dict[str, float]:
            started = time.perf_counter()
            metrics = actor.train_step()
            actor.step += 1
            return {**metrics, "seconds": time.perf_counter() - started}

        def rl_close() -> None:
            actor.rollouts.router.close()
            actor.rollouts.reward_source.close()

        return OurTrainer(work.task, actor, config, rl_step, rl_close)

    from aligner.data.loader import row_lengths

    if work.task == "sft":
        from aligner.algorithms.sft import SFTConfig as schema
        from aligner.algorithms.sft import build_sft_trainer as build
    else:
        from aligner.algorithms.dpo import DPOConfig as schema
        from aligner.algorithms.dpo import build_dpo_trainer as build
    config = load_config(schema, CONF_DIR / yaml_name, overrides)
    trainer = build(config)
    batches = trainer.train_loader.iterate(0)

    def step() -> dict[str, float]:
        started = time.perf_counter()  # as in Trainer.fit: fetching the batch belongs to the step
        microbatches = next(batches)
        metrics = trainer.train_step(microbatches, started=started)
        trainer.step += 1
        trainer.consumed_samples += work.global_batch_size
        return {**metrics, "seconds": time.perf_counter() - started,
                "sequence_tokens": sum(int(row_lengths(batch).sum()) for batch in microbatches)}

    return OurTrainer(work.task, trainer, config, step, trainer.metrics.close)


@contextlib.contextmanager
def ours_for_task(task: str, model: str, total_steps: int, work_dir: Optional[str] = None,
                  toy: bool = False) -> Iterator[OurTrainer]:
    """Our trainer for `train_steps.py`'s workload of `task` on `model` (resolved by benchmarks/models.py),
    its data written to work_dir (default: a temporary directory), closed on exit."""
    from models import resolve_model

    resolved = resolve_model(model)
    work = default_workload(task, total_steps, warmup_steps=0, toy=toy)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(work_dir or tmp)
        ours = build_ours(work, resolved.checkpoint_dir, write_data(work, scratch), scratch / "ours")
        try:
            yield ours
        finally:
            ours.close()
