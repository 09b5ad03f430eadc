"""The peer's side of a training-step comparison: TRL's own trainer, run by its own `train()` loop.

    .cache/bench/trl-venv/bin/python benchmarks/peer/trl_worker.py WORKLOAD_JSON HF_DIR DATA_JSONL SCRATCH_DIR

Runs in the TRL venv (benchmarks/peer/setup.sh). TRL's loop is left alone; a callback makes it take
turns with our side: it announces readiness at `on_train_begin` and waits there for the first "step";
at each `on_step_end` (after the optimizer step) it reports the step and waits for the next "step". So
a step's time covers everything between two optimizer steps: fetching and collating the batch, the
reference forward (DPO), generation and reward (RLOO), forward/backward and the optimizer.
Reports the tokens of each step: SFT/DPO the real (unpadded) tokens of the training forwards, RLOO the
tokens generated.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the `peer` package

from peer.protocol import WorkerChannel  # noqa: E402
from peer.workload import RL_TASKS, Workload, trl_config, trl_reward  # noqa: E402


def main() -> None:
    work_json, hf_dir, data, scratch = sys.argv[1:5]
    work = Workload.from_json(Path(work_json).read_text())
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(work.threads)
    import datasets
    import trl
    from transformers import AutoTokenizer, TrainerCallback

    trainer_name, kwargs = trl_config(work, Path(scratch) / "trl")
    config_class = getattr(trl, trainer_name.replace("Trainer", "Config"))
    args = config_class(**kwargs, model_init_kwargs={"dtype": torch.float32})
    dataset = datasets.load_dataset("json", data_files=str(data), split="train")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    channel = WorkerChannel()
    counted = {"tokens": 0.0}

    class TakeTurns(TrainerCallback):
        def on_train_begin(self, args, state, control, **_):
            channel.ready_then_wait()

        def on_step_end(self, args, state, control, **_):
            if work.task in RL_TASKS:  # this step's rollouts x their mean generated length
                lengths = trainer._metrics["train"]["completions/mean_length"]
                counted["tokens"] = lengths[-1] * work.rollouts_per_step
            channel.step_done(counted["tokens"])
            counted["tokens"] = 0.0
            if state.global_step < state.max_steps:
                channel.wait()

    extra = {}
    if work.task in RL_TASKS:
        import importlib

        module_name, _, function_name = work.reward_function.partition(":")
        extra["reward_funcs"] = trl_reward(getattr(importlib.import_module(module_name), function_name))
    trainer = getattr(trl, trainer_name)(model=hf_dir, args=args, train_dataset=dataset, processing_class=tokenizer,
                                         callbacks=[TakeTurns()], **extra)

    def count_training_tokens(module, args, kwargs):
        if torch.is_grad_enabled() and module.training:  # the training forwards, not generation or references
            mask = kwargs.get("attention_mask")
            ids = kwargs.get("input_ids", args[0] if args else None)
            counted["tokens"] += float(mask.sum()) if mask is not None else float(ids.numel())

    if work.task not in RL_TASKS:
        trainer.model.register_forward_pre_hook(count_training_tokens, with_kwargs=True)
    trainer.train()
    channel.finish()


if __name__ == "__main__":
    main()
