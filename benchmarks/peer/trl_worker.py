"""The peer's side of a training-step comparison: TRL's own trainer, run by its own `train()` loop.

    .cache/bench/trl-venv/bin/python benchmarks/peer/trl_worker.py WORKLOAD_JSON HF_DIR DATA_JSONL SCRATCH_DIR

Runs in the TRL venv (benchmarks/peer/setup.sh). TRL's loop is left alone; a callback makes it take
turns with our side: it announces readiness at `on_train_begin` and waits there for the first "step";
at each `on_step_end` (after the optimizer step) it reports the step and waits for the next "step". So
a step's time covers everything between two optimizer steps: fetching and collating the batch, the
reference forward (DPO), generation and reward (RLOO), forward/backward and the optimizer.
Reports the tokens of each step: SFT/DPO the real (unpadded) tokens of the training forwards, RLOO the
tokens generated; and what the model computed (`peer.workload.STEP_COUNTS`, by hooks on its embedding and
output layer, and the rows TRL's fused LM head projects; generate()'s forwards left out), SFT also the
positions its loss reads (labels not -100).
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the `peer` package

from peer.protocol import WorkerChannel  # noqa: E402
from peer.workload import RL_TASKS, STEP_COUNTS, Workload, trl_config, trl_reward  # noqa: E402


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
    computed: dict[str, float] = {}

    class TakeTurns(TrainerCallback):
        def on_train_begin(self, args, state, control, **_):
            channel.ready_then_wait()

        def on_step_end(self, args, state, control, **_):
            if work.task in RL_TASKS:  # this step's rollouts x their mean generated length
                lengths = trainer._metrics["train"]["completions/mean_length"]
                counted["tokens"] = lengths[-1] * work.rollouts_per_step
            figures = {name: computed.get(name, 0.0) for name in STEP_COUNTS}
            if work.task == "sft":
                figures["loss_positions"] = computed.get("loss_positions", 0.0)
            channel.step_done(counted["tokens"], {**figures, **sizes})
            counted["tokens"] = 0.0
            computed.clear()
            if state.global_step < state.max_steps:
                channel.wait()

    extra = {}
    if work.task in RL_TASKS:
        import importlib

        module_name, _, function_name = work.reward_function.partition(":")
        extra["reward_funcs"] = trl_reward(getattr(importlib.import_module(module_name), function_name))
    trainer = getattr(trl, trainer_name)(model=hf_dir, args=args, train_dataset=dataset, processing_class=tokenizer,
                                         callbacks=[TakeTurns()], **extra)
    model = trainer.model
    sizes = {"body_params": float(sum(p.numel() for p in model.model.layers.parameters())
                                  + sum(p.numel() for p in model.model.norm.parameters())),
             "head_params": float(model.lm_head.weight.numel())}
    generating = {"now": False}

    def add(name: str, value: float) -> None:
        kind = "train" if torch.is_grad_enabled() else "nograd"
        computed[f"{kind}_{name}"] = computed.get(f"{kind}_{name}", 0.0) + float(value)

    def count_model(module, args, kwargs):
        # generate()'s forwards carry a KV cache; the training, reference and logprob forwards do not
        generating["now"] = kwargs.get("past_key_values") is not None
        if generating["now"]:
            return
        if torch.is_grad_enabled():
            add("micro_steps", 1)
            if work.task not in RL_TASKS and module.training:  # SFT/DPO: the real tokens the step trains on
                mask = kwargs.get("attention_mask")
                ids = kwargs.get("input_ids", args[0] if args else None)
                counted["tokens"] += float(mask.sum()) if mask is not None else float(ids.numel())
        labels = kwargs.get("labels")
        if labels is not None:  # the positions a loss reads: labels not -100, shifted by one as the model does
            read = float((labels[..., 1:] != -100).sum() if kwargs.get("shift_labels") is None
                         else (kwargs["shift_labels"] != -100).sum())
            if kwargs.get("fused_lm_head"):  # TRL's fused head projects only these rows, not through lm_head
                add("lm_positions", read)
            if torch.is_grad_enabled():
                computed["loss_positions"] = computed.get("loss_positions", 0.0) + read

    def count_embedding(module, args, kwargs):
        if not generating["now"]:
            add("slots", (kwargs["input"] if "input" in kwargs else args[0]).numel())

    def count_output_layer(module, args, kwargs):
        if not generating["now"]:
            hidden = kwargs["input"] if "input" in kwargs else args[0]
            add("lm_positions", hidden.numel() // hidden.shape[-1])

    for counted_model in filter(None, (model, getattr(trainer, "ref_model", None))):  # DPO: its reference copy
        counted_model.register_forward_pre_hook(count_model, with_kwargs=True)
        counted_model.get_input_embeddings().register_forward_pre_hook(count_embedding, with_kwargs=True)
        counted_model.lm_head.register_forward_pre_hook(count_output_layer, with_kwargs=True)

    trainer.train()
    channel.finish()


if __name__ == "__main__":
    main()
