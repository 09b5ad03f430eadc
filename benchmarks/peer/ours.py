"""Our trainer for a `Workload`, built as its entry point builds it, and one step of it as `fit` runs it.

Shared by the worker of the TRL comparison (aligner_worker.py) and the benchmarks that run one trainer with a
setting alternated step by step (shared_prompts.py, output_layer_positions.py), so all of them time the same
step. Runs in the project's venv with benchmarks/ on sys.path.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from peer.workload import RL_TASKS, STEP_COUNTS, Workload, aligner_overrides, default_workload, write_data


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

    def set_shortcuts(self, on: frozenset[str]) -> None:
        """Switch each of `peer.workload.SHORTCUTS` on (in `on`) or off for the next steps (the waterfall)."""
        from aligner.runtime import cpu_products

        # training's products: the library `cpu_products` prefers on this CPU, or BLAS (what torch.matmul uses)
        os.environ[cpu_products.PREFERENCE_VARIABLE] = "auto" if "products" in on else "blas"
        engine = getattr(getattr(self.trainer, "rollouts", None), "engine", None)
        if engine is not None:
            # the engine's decode products on oneDNN (packed weights), or torch's own products; bound at build
            state = engine.state
            state.onednn_products = "products" in on and cpu_products.available(state.device, state.dtype)
            engine.shared_prefill = "shared_prefill" in on
        if self.task != "sft":
            self.config.packing.share_prompts = "shared_prompts" in on
        self.objective.reads_logits_at_positions = "logits_at_positions" in on


class StepCounter:
    """What our trainer's model computes per step, counted by hooks on its megatron modules: token slots (the
    input ids the forwards run over, padding included) and output-layer positions, each for the training
    forwards (gradients on: also the micro steps) and the no-gradient passes (reference, old logprobs); the
    native engine's generation is not counted (its tokens are reported apart). The output layer is counted
    where it runs: the module's forward, or a deferred loss's `logits_at` / `product_operands` rows."""

    def __init__(self, chunks) -> None:
        from megatron.core.utils import unwrap_model

        from aligner.models import deferred_output

        self.counts: dict[str, float] = {}
        for chunk in unwrap_model(list(chunks)):
            chunk.embedding.register_forward_pre_hook(self._embedding, with_kwargs=True)
            chunk.output_layer.register_forward_pre_hook(self._output_layer, with_kwargs=True)
        hidden = deferred_output.HiddenStates
        if not getattr(hidden, "_bench_counted", False):  # once per process: the class is shared
            logits_at, operands = hidden.logits_at, hidden.product_operands
            counter = self

            def counted_logits_at(states, flat_positions):
                counter._add("lm_positions", len(flat_positions))
                return logits_at(states, flat_positions)

            def counted_operands(states, flat_positions):
                result = operands(states, flat_positions)
                if result is not None:
                    counter._add("lm_positions", len(flat_positions))
                return result

            hidden.logits_at, hidden.product_operands, hidden._bench_counted = counted_logits_at, counted_operands, True
        unwrapped = unwrap_model(list(chunks))[0]
        self.body_params = sum(p.numel() for p in unwrapped.decoder.parameters())
        self.head_params = unwrapped.output_layer.weight.numel() if unwrapped.output_layer.weight is not None \
            else unwrapped.embedding.word_embeddings.weight.numel()  # tied: the embedding's table

    def _add(self, name: str, value: float) -> None:
        kind = "train" if torch.is_grad_enabled() else "nograd"
        self.counts[f"{kind}_{name}"] = self.counts.get(f"{kind}_{name}", 0.0) + float(value)

    def _embedding(self, module, args, kwargs) -> None:
        self._add("slots", (kwargs["input_ids"] if "input_ids" in kwargs else args[0]).numel())
        if torch.is_grad_enabled():
            self._add("micro_steps", 1)

    def _output_layer(self, module, args, kwargs) -> None:
        if not getattr(module, "deferred", False):
            hidden = kwargs["input_"] if "input_" in kwargs else args[0]
            self._add("lm_positions", hidden.numel() // hidden.shape[-1])

    def take(self) -> dict[str, float]:
        """The counts since the last call, with the model's sizes (for the driver's FLOP estimate)."""
        counts = {name: self.counts.get(name, 0.0) for name in STEP_COUNTS}
        self.counts = {}
        return {**counts, "body_params": float(self.body_params), "head_params": float(self.head_params)}



def build_ours(work: Workload, checkpoint_dir: Path, data: Path, scratch: Path) -> OurTrainer:
    """Our trainer of `work.task` from its conf yaml and `aligner_overrides`. A step: the RL actor collects,
    scores and trains on one rollout batch; SFT/DPO fetch the next batch inside the step (as `fit` does: DPO's
    swapped-in reference pass is part of it) and add "sequence_tokens", the step's sequences' real tokens as
    TRL counts them (the trainer's own count takes a shared prompt once), and SFT "loss_positions"."""
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
        counted = {"sequence_tokens": sum(int(row_lengths(batch).sum()) for batch in microbatches)}
        if work.task == "sft":  # the positions the loss reads (TRL's: labels not -100)
            counted["loss_positions"] = sum(float(batch["loss_mask"].sum()) for batch in microbatches)
        return {**metrics, "seconds": time.perf_counter() - started, **counted}

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
