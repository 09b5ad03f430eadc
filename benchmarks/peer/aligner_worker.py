"""Our side of a training-step comparison: the project's own trainer, stepped by the driver (protocol.py).

    python benchmarks/peer/aligner_worker.py WORKLOAD_JSON CHECKPOINT_DIR DATA_JSONL SCRATCH_DIR

Builds the trainer exactly as its entry point does and runs one step per "step" command the way `fit` does
(`ours.build_ours`); "step VARIANT" first switches the shortcuts the variant names on and the task's others off
(`peer.workload.waterfall`).
Reports the tokens of each step: SFT/DPO the real (unpadded) tokens of the step's sequences, RL the tokens generated
and the actor's `share_*` metrics (where the step's time went); and what the model computed (`ours.StepCounter`).
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the `peer` package

from peer.ours import StepCounter, build_ours  # noqa: E402
from peer.protocol import serve_steps  # noqa: E402
from peer.workload import RL_TASKS, Workload, shortcuts_of  # noqa: E402


def main() -> None:
    work_json, checkpoint_dir, data, scratch = sys.argv[1:5]
    work = Workload.from_json(Path(work_json).read_text())
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(work.threads)
    ours = build_ours(work, Path(checkpoint_dir), Path(data), Path(scratch))
    counter = StepCounter(ours.trainer.chunks)

    def step(variant: str = ""):
        if variant:  # the waterfall: these shortcuts on, the task's others off
            ours.set_shortcuts(shortcuts_of(variant))
        metrics = ours.step()
        figures = counter.take()
        if work.task in RL_TASKS:  # the tokens generated, and the phases' shares of the step
            return metrics["generated_tokens"], {**figures, **{key: value for key, value in metrics.items()
                                                               if key.startswith("share_")}}
        if "loss_positions" in metrics:
            figures["loss_positions"] = metrics["loss_positions"]
        return metrics["sequence_tokens"], figures

    try:
        serve_steps(step)
    finally:
        ours.close()


if __name__ == "__main__":
    main()
