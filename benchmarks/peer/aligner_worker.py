"""Our side of a training-step comparison: the project's own trainer, stepped by the driver (protocol.py).

    python benchmarks/peer/aligner_worker.py WORKLOAD_JSON CHECKPOINT_DIR DATA_JSONL SCRATCH_DIR

Builds the trainer exactly as its entry point does (conf yaml + `workload.aligner_overrides`), then runs
one step per "step" command the way `fit` does: SFT/DPO fetch the next batch inside the step (DPO's
swapped-in reference pass is part of it), the RL actor collects, scores and trains on one rollout batch.
Reports the tokens of each step: SFT/DPO the real (unpadded) tokens of the step's sequences, RL the tokens generated
and the actor's `share_*` metrics (where the step's time went).
"""
from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the `peer` package

from peer.protocol import serve_steps  # noqa: E402
from peer.workload import RL_TASKS, Workload, aligner_overrides  # noqa: E402


def main() -> None:
    work_json, checkpoint_dir, data, scratch = sys.argv[1:5]
    work = Workload.from_json(Path(work_json).read_text())
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(work.threads)
    from aligner.config import CONF_DIR, load_config

    yaml_name, overrides = aligner_overrides(work, Path(checkpoint_dir), Path(data), Path(scratch))
    if work.task in RL_TASKS:
        from aligner.algorithms.rl_actor import RLActorConfig, build_rl_actor

        actor = build_rl_actor(load_config(RLActorConfig, CONF_DIR / yaml_name, overrides))

        def step() -> tuple[float, dict[str, float]]:
            metrics = actor.train_step()
            actor.step += 1  # the phases' shares of the step (generation, logprobs, training, ...)
            return metrics["generated_tokens"], {key: value for key, value in metrics.items()
                                                 if key.startswith("share_")}

        try:
            serve_steps(step)
        finally:
            actor.router.close()
            actor.reward_source.close()
        return

    if work.task == "sft":
        from aligner.algorithms.sft import SFTConfig as schema
        from aligner.algorithms.sft import build_sft_trainer as build
    else:
        from aligner.algorithms.dpo import DPOConfig as schema
        from aligner.algorithms.dpo import build_dpo_trainer as build
    trainer = build(load_config(schema, CONF_DIR / yaml_name, overrides))
    batches = trainer.train_loader.iterate(0)

    from aligner.data.loader import row_lengths

    def step() -> float:
        started = time.perf_counter()  # as in Trainer.fit: fetching the batch belongs to the step
        microbatches = next(batches)
        trainer.train_step(microbatches, started=started)
        trainer.step += 1
        trainer.consumed_samples += work.global_batch_size
        # the sequences' tokens, as TRL counts them (the trainer's own count takes a shared prompt once)
        return sum(int(row_lengths(batch).sum()) for batch in microbatches)

    serve_steps(step)
    trainer.metrics.close()


if __name__ == "__main__":
    main()
