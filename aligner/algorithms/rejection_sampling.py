"""Rejection sampling (best-of-n): sample n answers per prompt, score them, fine-tune on the best.

    for iteration in 1..N:
        prompts  = this iteration's slice of the prompt file (a seeded order, wrapping around)
        answers  = n samples per prompt from the live model (NativeEngine), split over the DP replicas
        scores   = the reward function or the reward-model server, each replica scoring its own share
        kept     = per prompt the best answer (rs.keep=best, optionally at least rs.min_score), or every
                   answer scoring at least rs.min_score (rs.keep=threshold); answers that never stopped
                   are not kept unless rs.require_stop=false
        write    log_dir/rejection_sampling/iteration_<i>.jsonl: every sample, its score and whether kept
        train    rs.epochs_per_iteration passes of SFT (the loss on the answer tokens) over the kept samples
        save     a checkpoint: a stopped run resumes at the next iteration

Everything an iteration does follows from the weights at its start and seeds derived from `seed`
and the iteration, so a resumed run repeats the uninterrupted one. Each iteration's step count
depends on how many samples were kept; the LR schedule is laid out for the most an iteration can
keep (every prompt once with keep=best, every sample with keep=threshold).
"""
from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Optional

import torch

from aligner import checkpointing
from aligner.algorithms.rl_build import build_reward_source
from aligner.algorithms.rl_config import ServerAddress
from aligner.algorithms.sft import SFTObjective
from aligner.config import at_least, one_of
from aligner.data.records import Layouts
from aligner.generation.engine import SamplingParams
from aligner.generation.native import NativeEngine
from aligner.generation.rewards import RewardFunctionSettings
from aligner.generation.rollouts import PROMPT_LAYOUTS, PromptDataset, gather_shares, generate_share
from aligner.runtime.errors import ConfigError
from aligner.training import setup
from aligner.training.loop import Cadence, RunLoop, run_loop
from aligner.training.setup import RunConfig
from aligner.training.trainer import Trainer

KEEP_RULES = ("best", "threshold")
META_KEY = "rejection_sampling"  # checkpoint meta: {"iterations_done": N}


# ----------------------------------------------------------------------------- config schema
@dataclass
class RSGenerationConfig:
    """How the n answers are sampled (`rs.generation:`)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = at_least(1, 256)
    batch_size: int = at_least(1, 64)  # prompts per seeded batch; the KV cache's rows


@dataclass
class RSSection:
    """The `rs:` section."""

    num_iterations: int = at_least(1, 1)
    prompts_per_iteration: int = at_least(1, 256)
    samples_per_prompt: int = at_least(1, 4)  # n
    keep: str = one_of(KEEP_RULES, "best")
    min_score: Optional[float] = None  # best: also at least this; threshold: the bar (required)
    require_stop: bool = True  # answers cut at max_new_tokens (no stop token) are never kept
    epochs_per_iteration: int = at_least(1, 1)
    generation: RSGenerationConfig = field(default_factory=RSGenerationConfig)


@dataclass
class RSRewardSection(RewardFunctionSettings):
    """What scores the answers: a reward-model server or Python functions (function / functions:
    RewardFunctionSettings' keys; RewardChecks' checks of the scores: timeout_s, max_abs, on_invalid,
    invalid_value)."""

    source: str = one_of(("server", "function"), "function")
    server: ServerAddress = field(default_factory=ServerAddress)
    attribute_index: int = 0  # which output of a multi-attribute reward model is the score


@dataclass
class RSDataConfig:
    prompts: str = "???"  # a data file (JSONL, Parquet, Arrow, datasets dir) of {"prompt": text or messages}
    max_prompt_length: int = at_least(1, 256)  # longer prompts are skipped
    chat_template: bool = True
    shuffle: bool = True
    pad_to_multiple_of: Optional[int] = at_least(1, None, "null: 8 on GPU, 1 (the TP size at TP > 1) on CPU")

    def sources(self) -> list[tuple[str, str]]:
        return [("data.prompts", self.prompts)]


@dataclass
class RSTrainerConfig:
    global_batch_size: int = at_least(1, 32)  # kept samples per optimizer step
    micro_batch_size: int = at_least(1, 4)


@dataclass
class RSConfig(RunConfig):
    """conf/gpt_rs.yaml: the shared run sections plus `rs`, `reward`, and RS's own `trainer` and `data`."""

    LR_METHOD = "sft"  # its row in aligner/training/lr_ranges.py
    name: str = "gpt_rs"
    rs: RSSection = field(default_factory=RSSection)
    reward: RSRewardSection = field(default_factory=RSRewardSection)
    trainer: RSTrainerConfig = field(default_factory=RSTrainerConfig)
    data: RSDataConfig = field(default_factory=RSDataConfig)

    def data_layouts(self) -> Layouts:
        return PROMPT_LAYOUTS

    def sequence_lengths(self) -> list[tuple[int, str]]:
        # Generated and trained on alike: a prompt + its answer.
        prompt, new = self.data.max_prompt_length, self.rs.generation.max_new_tokens
        return [(prompt + new, f"data.max_prompt_length + rs.generation.max_new_tokens = {prompt} + {new} = "
                               f"{prompt + new}")]


def check_rs_config(cfg: RSConfig) -> None:
    rs = cfg.rs
    if rs.keep == "threshold" and rs.min_score is None:
        raise ConfigError("rs.keep=threshold keeps every answer scoring at least rs.min_score: set rs.min_score")
    if cfg.reward.source == "function" and not cfg.reward.function_entries():
        raise ConfigError("reward.source=function needs reward.function=path/to/file.py:function (or "
                          "package.module:function, or a weighted list in reward.functions)")
    if rs.generation.temperature <= 0:
        raise ConfigError(f"rs.generation.temperature must be > 0 (best-of-n needs different samples), got "
                          f"{rs.generation.temperature}")


# ----------------------------------------------------------------------------- selection
def select(scores: list[list[float]], stopped: list[list[bool]], keep: str, min_score: Optional[float],
           require_stop: bool) -> list[list[bool]]:
    """Which samples are kept: scores[p][s] / stopped[p][s] of sample s of prompt p -> kept[p][s].

    best: the highest-scoring eligible sample of each prompt (the first on ties), if it reaches
    min_score (when set); threshold: every eligible sample scoring at least min_score. Eligible: it
    stopped, unless require_stop is false."""
    kept = []
    for prompt_scores, prompt_stopped in zip(scores, stopped):
        eligible = [s for s, ended in enumerate(prompt_stopped) if ended or not require_stop]
        if min_score is not None:
            eligible = [s for s in eligible if prompt_scores[s] >= min_score]
        chosen = set(eligible)
        if keep == "best" and eligible:
            chosen = {max(eligible, key=lambda s: (prompt_scores[s], -s))}
        kept.append([s in chosen for s in range(len(prompt_scores))])
    return kept


class KeptSamples(torch.utils.data.Dataset):
    """SFT items of the kept (prompt, answer) token lists: the loss on the answer's tokens only."""

    def __init__(self, samples: list[tuple[list[int], list[int]]]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        prompt, answer = self.samples[index]
        return {"tokens": torch.tensor(prompt + answer, dtype=torch.long),
                "loss_mask": torch.tensor([0] * len(prompt) + [1] * len(answer), dtype=torch.long)}


# ----------------------------------------------------------------------------- the run
class RejectionSamplingRun:
    """The iterations around a shared Trainer (which owns the model, optimizer and metrics), whose steps run
    in the one run loop (`aligner.training.loop`)."""

    def __init__(self, cfg: RSConfig, trainer: Trainer, built, prompts, reward_source, first_iteration: int):
        from megatron.core import parallel_state as ps

        self.cfg, self.trainer, self.built, self.prompts = cfg, trainer, built, prompts
        self.metrics = trainer.metrics  # what `aligner.training.run.run_training` closes
        self.reward_source = reward_source
        self.first_iteration = first_iteration
        tokenizer = built.tokenizer
        self.engine = NativeEngine(built.chunks, built.model_cfg, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
                                   max_batch_size=cfg.rs.generation.batch_size, decode=tokenizer.decode,
                                   max_sequence_length=cfg.data.max_prompt_length + cfg.rs.generation.max_new_tokens)
        self.data_parallel = (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                              ps.get_data_parallel_group())
        self.order = list(range(len(prompts)))  # iterations take consecutive slices, wrapping around
        random.Random(cfg.seed).shuffle(self.order)
        self.samples_dir = Path(cfg.logging.log_dir) / "rejection_sampling"

    def iteration_prompts(self, iteration: int) -> list[int]:
        count = self.cfg.rs.prompts_per_iteration
        return [self.order[(iteration * count + i) % len(self.order)] for i in range(count)]

    def sampling(self, iteration: int):
        generation = self.cfg.rs.generation
        return SamplingParams(max_new_tokens=generation.max_new_tokens, temperature=generation.temperature,
                              top_k=generation.top_k, top_p=generation.top_p, seed=self.cfg.seed + iteration)

    def response_text(self, ids: list[int]) -> str:
        eos = self.built.tokenizer.eos_id
        return self.built.tokenizer.decode([t for t in ids if t != eos])

    def sample_and_score(self, iteration: int) -> tuple[list[int], list[list[int]], list[str], list[float], int]:
        """(prompt indices, answers, their texts, scores, how many scores were invalid and replaced) of this
        iteration, row r = prompt r // n, sample r % n; every rank returns all of them (each replica generates
        and scores its share, then they are gathered)."""
        n = self.cfg.rs.samples_per_prompt
        indices = self.iteration_prompts(iteration)
        rows = [self.prompts.tokens[index] for index in indices for _ in range(n)]
        replica, replicas, group = self.data_parallel
        share = generate_share(self.engine, rows, self.sampling(iteration), self.cfg.rs.generation.batch_size,
                               replica, replicas)
        mine = sorted(share)
        texts = [self.response_text(share[r]) for r in mine]  # decoded once: scored, then written to the JSONL
        scores, replaced = [], []
        if mine:
            checked = self.reward_source.score_async(
                [rows[r] + share[r] for r in mine], [self.prompts.prompts[indices[r // n]] for r in mine],
                texts, [self.prompts.record(indices[r // n]) for r in mine],
                columns=[self.prompts.columns(indices[r // n]) for r in mine]).result()
            scores, replaced = checked.values.tolist(), checked.replaced.tolist()
        scored = gather_shares({r: (share[r], text, score, bad) for r, text, score, bad
                                in zip(mine, texts, scores, replaced)}, replicas, group)
        answers, texts, scores, replaced = zip(*(scored[r] for r in range(len(rows))))
        return indices, list(answers), list(texts), [float(score) for score in scores], sum(replaced)

    def write_samples(self, iteration: int, indices, texts, scores, kept) -> Path:
        """Every sample of the iteration as JSONL (rank 0), written whole before it is renamed into place."""
        import torch.distributed as dist

        path = self.samples_dir / f"iteration_{iteration + 1:03d}.jsonl"
        if not dist.is_initialized() or dist.get_rank() == 0:
            self.samples_dir.mkdir(parents=True, exist_ok=True)
            n = self.cfg.rs.samples_per_prompt
            partial = path.with_suffix(".jsonl.partial")
            with open(partial, "w") as out:
                for row, (text, score) in enumerate(zip(texts, scores)):
                    out.write(json.dumps({"prompt": self.prompts.prompts[indices[row // n]], "sample": row % n,
                                          "response": text, "score": score,
                                          "kept": kept[row // n][row % n]}) + "\n")
            os.replace(partial, path)
        return path

    def nothing_to_train(self) -> Optional[tuple[str, str]]:
        """("already at iteration N of rs.num_iterations=N", its key) when a resumed run has no iteration left."""
        iterations = self.cfg.rs.num_iterations
        if self.first_iteration < iterations:
            return None
        return f"already at iteration {self.first_iteration} of rs.num_iterations={iterations}", "rs.num_iterations"

    def fit(self) -> None:
        checkpoint = self.cfg.checkpoint
        # Saves happen at iteration ends only (`run_iteration`); the loop checks the stop signals.
        cadence = Cadence(save_at_end=False, stop_grace_s=checkpoint.stop_grace_s)
        try:
            with run_loop(self.trainer, cadence) as loop:
                for iteration in range(self.first_iteration, self.cfg.rs.num_iterations):
                    loop.check()  # an iteration end: resumable
                    self.run_iteration(iteration, loop)
        finally:
            self.engine.free()
            self.reward_source.close()

    def run_iteration(self, iteration: int, loop: RunLoop) -> None:
        cfg, trainer, rs = self.cfg, self.trainer, self.cfg.rs
        n = rs.samples_per_prompt
        indices, answers, texts, scores, replaced = self.sample_and_score(iteration)
        eos = self.built.tokenizer.eos_id
        by_prompt = [scores[p * n:(p + 1) * n] for p in range(len(indices))]
        stopped = [[bool(answer) and answer[-1] == eos for answer in answers[p * n:(p + 1) * n]]
                   for p in range(len(indices))]
        kept = select(by_prompt, stopped, rs.keep, rs.min_score, rs.require_stop)
        path = self.write_samples(iteration, indices, texts, scores, kept)
        samples = [(self.prompts.tokens[indices[p]], answers[p * n + s]) for p in range(len(indices))
                   for s in range(n) if kept[p][s]]
        best = [max(prompt_scores) for prompt_scores in by_prompt]
        report = {"iteration": iteration + 1, "score_mean": sum(scores) / len(scores),
                  "best_of_n_mean": sum(best) / len(best), "kept": len(samples),
                  "kept_score_mean": (sum(scores[p * n + s] for p in range(len(indices)) for s in range(n)
                                          if kept[p][s]) / len(samples)) if samples else float("nan"),
                  "stopped_fraction": sum(map(sum, stopped)) / len(scores)}
        if cfg.reward.on_invalid == "replace":  # samples whose invalid score was replaced by reward.invalid_value
            report["invalid_scores"] = replaced
        trainer.metrics.log(trainer.step, report, prefix="rs")
        trainer.metrics.write(f"rejection sampling iteration {iteration + 1}/{rs.num_iterations}: {len(scores)} "
                              f"samples, mean score {report['score_mean']:.4f}, best of {n} "
                              f"{report['best_of_n_mean']:.4f}, {len(samples)} kept -> {path}")
        if len(samples) < cfg.trainer.global_batch_size:
            trainer.metrics.write(f"iteration {iteration + 1}: {len(samples)} kept samples are fewer than "
                                  f"trainer.global_batch_size={cfg.trainer.global_batch_size}: no training step")
        else:
            loader = setup.build_loader(KeptSamples(samples), trainer_cfg=cfg.trainer,
                                        data_parallel_size=self.built.data_parallel_size, seed=cfg.seed + iteration,
                                        shuffle=cfg.data.shuffle, pad_id=self.built.tokenizer.pad_id,
                                        pad_to_multiple_of=cfg.data.pad_to_multiple_of)
            reason = (f"rejection sampling resumes only at iteration ends: iteration {iteration + 1} is repeated "
                      "from the newest checkpoint")
            for microbatches in loader.iterate(0, epochs=rs.epochs_per_iteration):
                loop.step(partial(trainer.train_step, microbatches), extra={"iteration": iteration + 1},
                          resumable=False, unsaved_reason=reason)
        trainer.checkpoint_meta[META_KEY] = {"iterations_done": iteration + 1}
        interval, last = cfg.checkpoint.save_interval, iteration + 1 == rs.num_iterations
        if (cfg.checkpoint.save_at_end and last) or (interval > 0 and (iteration + 1) % interval == 0 and not last):
            trainer.save()


def build_rs_run(cfg: RSConfig) -> RejectionSamplingRun:
    """Runtime, model, prompts, reward source, SFT objective, optimizer, metrics, resume: ready to `fit()`."""
    check_rs_config(cfg)
    rs = cfg.rs
    # The RL actor's, before the model: a function that cannot load or fails on the first record fails fast
    reward_source = build_reward_source(cfg.reward, probe_prompts=cfg.data.prompts)
    built = setup.build_training_model(
        parallel=cfg.parallel, precision=cfg.precision, seed=cfg.seed, model=cfg.model, tokenizer=cfg.tokenizer,
        optim=cfg.optim, save_dir=cfg.checkpoint.save_dir, resume=cfg.checkpoint.resume,
        lock_wait_s=cfg.checkpoint.lock_wait_s, peft=cfg.peft,
        sequence_lengths=cfg.sequence_lengths(),
    )
    prompts = PromptDataset(cfg.data.prompts, built.tokenizer, cfg.data.max_prompt_length, cfg.data.chat_template)
    most_kept = rs.prompts_per_iteration * (1 if rs.keep == "best" else rs.samples_per_prompt)
    steps_per_iteration = rs.epochs_per_iteration * math.floor(most_kept / cfg.trainer.global_batch_size)
    trainer = setup.build_trainer(cfg, built, SFTObjective(built.model_cfg.vocab_size),
                                  total_steps=max(rs.num_iterations * steps_per_iteration, 1),
                                  length_settings={"rs.num_iterations": rs.num_iterations,
                                                   "rs.prompts_per_iteration": rs.prompts_per_iteration})
    first_iteration = 0
    if built.resume_checkpoint is not None:
        trainer.resume_from(built.resume_checkpoint)
        done = checkpointing.read_meta(built.resume_checkpoint).get(META_KEY)
        if done is None:
            raise ConfigError(f"{built.resume_checkpoint} is not a rejection-sampling checkpoint (no {META_KEY!r} in "
                              "its meta); use another checkpoint.save_dir or checkpoint.resume=false")
        first_iteration = done["iterations_done"]
        trainer.checkpoint_meta[META_KEY] = done
    if prompts.skipped_note:
        trainer.metrics.write(f"warning: {prompts.skipped_note}")
    trainer.metrics.write(
        f"{cfg.name}: {rs.num_iterations} iterations of {rs.prompts_per_iteration} prompts x {rs.samples_per_prompt} "
        f"samples, keep {rs.keep}{'' if rs.min_score is None else f' (score >= {rs.min_score})'}, "
        f"{rs.epochs_per_iteration} epoch(s) of SFT on the kept samples per iteration; {len(prompts)} prompts "
        f"({prompts.too_long} longer than {cfg.data.max_prompt_length} tokens skipped); "
        f"TP={cfg.parallel.tensor_model_parallel_size} PP={cfg.parallel.pipeline_model_parallel_size} "
        f"DP={built.data_parallel_size}"
        + (f"; resuming at iteration {first_iteration + 1}" if first_iteration else ""))
    return RejectionSamplingRun(cfg, trainer, built, prompts, reward_source, first_iteration)
