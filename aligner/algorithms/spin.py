"""Self-play fine-tuning (SPIN): the model learns to prefer the demonstrations over its own answers.

    for iteration in 1..N:
        reference = the model now (HostWeights snapshot, or logprobs precomputed with it)
        rejected  = the model's own responses to this iteration's SFT prompts (NativeEngine)
        train steps_per_iteration steps of the DPO loss on (prompt, demonstration, own response)
                   with this iteration's beta (spin.kl_betas)

The loss is DPO's (`aligner.algorithms.dpo.DPOObjective`), the pairs are `PreferenceDataset`
rows built in memory, and the steps are the shared Trainer's `train_step` in the one run loop
(`aligner.training.loop`): only the iterations are SPIN's. When the model already reproduces a
demonstration, chosen and rejected are the same sequence and the pair carries no gradient; the share
of such pairs (`self_match`) is logged per iteration: it is how far SPIN has left to go on those prompts.

A stop (SIGTERM/SIGINT, aligner/runtime/stopping.py) is acted on at the next step boundary: at an
iteration end (or before the first step of an iteration) it writes a checkpoint there; in the
middle of an iteration it exits without one, since a run cannot resume mid-iteration, and the
iteration is repeated from the newest checkpoint by the resumed run.

Checkpoints are written at iteration ends only (the first one on or after each multiple of
`checkpoint.save_interval` steps, and the last), and a run resumes from the newest one at the next
iteration. Nothing else needs saving: an iteration's self-play answers, reference and
data order follow from the weights at its start and seeds derived from `seed` and the iteration,
so a resumed run repeats the uninterrupted one step for step (tests/unit/test_spin.py).

Self-play generation is split over the data-parallel replicas (batches dealt round-robin, each
with a seed of its own, answers gathered), so every rank trains on the same pairs at any DP size.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

from aligner.algorithms.dpo import (
    REFERENCE_MODES,
    DPOObjective,
    DPOSection,
    SwappedReferenceLoader,
    precompute_reference_logprobs,
)
from aligner.config import at_least, one_of
from aligner.data.conversation import ChatEncoder, parse_answer, parse_prompt, template_errors
from aligner.data.jsonl import DataError, require_str
from aligner.data.preference import PreferenceDataset, PreferencePair, collate_preferences
from aligner.data.records import Layouts, read_records
from aligner.data.sft import SFT_LAYOUTS, conversation_key, parse_conversation
from aligner.generation.engine import SamplingParams
from aligner.generation.native import NativeEngine
from aligner.generation.rollouts import gather_shares, generate_share
from aligner.models import lora
from aligner.models.weight_swap import HostWeights
from aligner.runtime.errors import ConfigError
from aligner.training import setup
from aligner.training.loop import Cadence, RunLoop, run_loop
from aligner.training.metrics import get_logger
from aligner.training.setup import RunConfig, entry_sources
from aligner.training.trainer import Trainer


# ----------------------------------------------------------------------------- config schema
@dataclass
class SPINGenerationConfig:
    """How the model answers the prompts each iteration (`spin.generation:`)."""

    greedy: bool = True  # false: sample with temperature / top_k / top_p
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = at_least(1, 64)
    batch_size: int = at_least(1, 256)  # prompts per seeded batch; the KV cache's rows (refilled across batches)


@dataclass
class SPINSection:
    """The `spin:` section."""

    num_iterations: int = at_least(1, 1)
    steps_per_iteration: int = at_least(1, 100)  # optimizer steps per iteration (global_batch_size pairs each)
    kl_betas: list = field(default_factory=lambda: [0.1])  # beta per iteration; one value: every iteration
    sft_loss_weight: float = 0.0  # > 0: add this weight times the NLL of the demonstration
    preference_average_logprobs: bool = False
    reference_logprobs: str = one_of(REFERENCE_MODES, "swap")  # swap: a snapshot of the iteration's start
    generation: SPINGenerationConfig = field(default_factory=SPINGenerationConfig)


@dataclass
class DemonstrationFile:
    path: str = "???"


@dataclass
class SPINTrainerConfig:
    """The `trainer:` section: SPIN's length is spin.num_iterations x spin.steps_per_iteration."""

    global_batch_size: int = at_least(1, 32)  # pairs
    micro_batch_size: int = at_least(1, 4)  # pairs


@dataclass
class SPINDataConfig:
    """The `data:` section: SFT demonstrations (no validation: self-play has no held-out pairs)."""

    train: list[DemonstrationFile] = field(default_factory=list)  # all files are used, concatenated
    max_seq_length: int = at_least(2, 512)
    shuffle: bool = True
    pad_to_multiple_of: Optional[int] = at_least(1, None, "null: 8 on GPU, 1 (the TP size at TP > 1) on CPU")
    chat_template: bool = True  # render with the tokenizer's chat template (if it has one)

    def sources(self) -> list[tuple[str, str]]:
        return entry_sources("data.train", self.train)


# `demonstration`'s layouts: an SFT record, or a prompt with its response
DEMONSTRATION_LAYOUTS = Layouts("demonstration", SFT_LAYOUTS.choices + (("prompt", "response"),))


@dataclass
class SPINConfig(RunConfig):
    """conf/gpt_spin.yaml: the shared run sections plus `spin`, with SPIN's own `trainer` and `data`."""

    LR_METHOD = "preference"  # its row in aligner/training/lr_ranges.py
    name: str = "gpt_spin"
    spin: SPINSection = field(default_factory=SPINSection)
    trainer: SPINTrainerConfig = field(default_factory=SPINTrainerConfig)
    data: SPINDataConfig = field(default_factory=SPINDataConfig)

    def sequence_lengths(self) -> list[tuple[int, str]]:
        # The self-play engine's rows: a demonstration's prompt (under data.max_seq_length) + a generated answer.
        seq, new = self.data.max_seq_length, self.spin.generation.max_new_tokens
        return [(seq + new, f"data.max_seq_length + spin.generation.max_new_tokens = {seq} + {new} = {seq + new}")]

    def data_layouts(self) -> Layouts:
        return DEMONSTRATION_LAYOUTS


def iteration_betas(spin: SPINSection) -> list[float]:
    """One beta per iteration from spin.kl_betas (a single value applies to all)."""
    betas = [float(beta) for beta in spin.kl_betas]
    if len(betas) == 1:
        betas = betas * spin.num_iterations
    if len(betas) != spin.num_iterations:
        raise ConfigError(f"spin.kl_betas has {len(betas)} values for spin.num_iterations={spin.num_iterations}; "
                          "give one per iteration, or a single value for all")
    if any(beta <= 0 for beta in betas):
        raise ConfigError(f"spin.kl_betas must be > 0, got {betas}")
    return betas


def dpo_section(spin: SPINSection, beta: float) -> DPOSection:
    """The DPO loss settings of one SPIN iteration."""
    return DPOSection(beta=beta, preference_loss="dpo", sft_loss_weight=spin.sft_loss_weight,
                      preference_average_logprobs=spin.preference_average_logprobs,
                      reference_logprobs=spin.reference_logprobs)


# ----------------------------------------------------------------------------- data
def demonstration(record: dict, path: str, line: int):
    """(prompt, answer text) of one demonstration record; the prompt is text or messages.

    {"input", "output"}; {"prompt", "response" or "completion"} (a conversational prompt, the answer as text or an
    assistant message); or a conversation, {"system"?, "conversations"} (the SFT file layout) or
    {"messages"}, whose last turn is the assistant's reply: the earlier turns are its prompt.
    """
    if "input" in record or "output" in record:
        return require_str(record, "input", path, line), require_str(record, "output", path, line)
    if "prompt" in record or "response" in record or "completion" in record:
        answer_key = "completion" if "completion" in record else "response"  # TRL's name, or the reward data's
        return parse_prompt(record, "prompt", path, line), parse_answer(record, answer_key, path, line)
    key = conversation_key(record)
    if key is None:
        raise DataError(f"{path}:{line}: record has none of 'input'/'output', 'prompt'/'response' (or "
                        f"'completion'), 'conversations' or 'messages' "
                        f"(keys present: {', '.join(sorted(map(repr, record))) or 'none'})")
    # The SFT reader's turns, system message included: they open with a user turn and end with the reply.
    messages = parse_conversation(record, path, line)
    return messages[:-1], messages[-1]["content"]


def load_demonstrations(path: str, tokenizer, max_seq_length: int,
                        use_template: bool = True) -> list[tuple[list[int], list[int]]]:
    """(prompt tokens, response tokens) of each record (`demonstration`), as `ChatEncoder.sample_tokens`
    lays them out: prompt + response is the SFT encoding of the conversation up to the end of the
    reply. Records longer than max_seq_length are dropped.
    """
    encoder = ChatEncoder(tokenizer, use_template)
    demonstrations = []
    for line, record in read_records(path):
        prompt, answer = demonstration(record, path, line)
        with template_errors(path, line):
            prompt_tokens, answer_tokens = encoder.sample_tokens(prompt, answer)
        if len(prompt_tokens) + len(answer_tokens) <= max_seq_length:
            demonstrations.append((prompt_tokens, answer_tokens))
    if not demonstrations:
        raise DataError(f"{path}: no usable demonstrations (none fits max_seq_length={max_seq_length})")
    return demonstrations


def self_play_pairs(engine, demonstrations: list, sampling, batch_size: int, replica: int = 0, replicas: int = 1,
                    group=None):
    """PreferencePairs (demonstration chosen, own response rejected) and the share of identical ones.

    The demonstrations go to the engine in batches of batch_size, dealt round-robin to the
    data-parallel replicas (`replica` of `replicas`; the answers are gathered over `group`), and
    each batch samples with a seed of its own first index: every rank returns the same pairs,
    whatever the number of replicas.
    """
    share = generate_share(engine, [prompt for prompt, _ in demonstrations], sampling, batch_size, replica, replicas)
    answers = gather_shares(share, replicas, group)  # demonstration index -> the model's response ids
    pairs = [PreferencePair(list(prompt), list(response), answers[index])
             for index, (prompt, response) in enumerate(demonstrations)]
    identical = sum(pair.rejected == pair.chosen for pair in pairs)
    return pairs, identical / len(demonstrations)


# ----------------------------------------------------------------------------- the run
class SPINRun:
    """SPIN's iterations around a shared Trainer (which owns the model, optimizer and metrics), whose steps
    run in the one run loop (`aligner.training.loop`)."""

    def __init__(self, cfg: SPINConfig, trainer: Trainer, built, demonstrations: list):
        from megatron.core import parallel_state as ps

        self.cfg, self.trainer, self.built = cfg, trainer, built
        self.metrics = trainer.metrics  # what `aligner.training.run.run_training` closes
        self.demonstrations = demonstrations
        self.betas = iteration_betas(cfg.spin)
        self.engine = NativeEngine(built.chunks, built.model_cfg, pad_id=built.tokenizer.pad_id,
                                   eos_id=built.tokenizer.eos_id, max_batch_size=cfg.spin.generation.batch_size,
                                   max_sequence_length=cfg.data.max_seq_length + cfg.spin.generation.max_new_tokens)
        # (this replica, replicas, their group): self-play generation is split over the replicas.
        self.data_parallel = (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                              ps.get_data_parallel_group())
        # A fixed order of the demonstrations; iterations take consecutive slices (wrapping around).
        self.order = list(range(len(demonstrations)))
        random.Random(cfg.seed).shuffle(self.order)

    def nothing_to_train(self) -> Optional[tuple[str, str]]:
        """("already at step N of N (spin.num_iterations=I ...)", its key) when a resumed run has no step left."""
        spin, step = self.cfg.spin, self.trainer.step
        if self.trainer.saved_at is None or step < spin.num_iterations * spin.steps_per_iteration:
            return None
        return (f"already at step {step} of {spin.num_iterations * spin.steps_per_iteration} "
                f"(spin.num_iterations={spin.num_iterations} x spin.steps_per_iteration={spin.steps_per_iteration})",
                "spin.num_iterations")

    def sampling(self, iteration: int):
        generation = self.cfg.spin.generation
        return SamplingParams(max_new_tokens=generation.max_new_tokens, greedy=generation.greedy,
                              temperature=generation.temperature, top_k=generation.top_k, top_p=generation.top_p,
                              seed=self.cfg.seed + iteration)

    def iteration_demonstrations(self, iteration: int) -> list:
        needed = self.cfg.spin.steps_per_iteration * self.cfg.trainer.global_batch_size
        start = iteration * needed
        return [self.demonstrations[self.order[(start + i) % len(self.order)]] for i in range(needed)]

    def fit(self) -> None:
        checkpoint = self.cfg.checkpoint
        # Saves happen at iteration ends only (`_iterate`); the loop saves the end and checks the stop signals.
        cadence = Cadence(save_at_end=checkpoint.save_at_end, stop_grace_s=checkpoint.stop_grace_s)
        with run_loop(self.trainer, cadence) as loop:
            self._iterate(loop)
        self.engine.free()

    def _stop_mid_iteration_reason(self, iteration: int) -> str:
        return (f"SPIN resumes only at iteration ends: iteration {iteration + 1} is repeated from the newest "
                "checkpoint")

    def _iterate(self, loop: RunLoop) -> None:
        cfg, trainer, built = self.cfg, self.trainer, self.built
        vocab_size = built.model_cfg.vocab_size
        first_iteration = trainer.step // cfg.spin.steps_per_iteration  # > 0 after a resume
        for iteration, beta in enumerate(self.betas):
            if iteration < first_iteration:
                continue
            loop.check()  # an iteration end: resumable
            # The reference of this iteration is the model as it is now.
            pairs, self_match = self_play_pairs(self.engine, self.iteration_demonstrations(iteration),
                                                self.sampling(iteration), cfg.spin.generation.batch_size,
                                                *self.data_parallel)
            dataset = PreferenceDataset(pairs, source=f"SPIN iteration {iteration + 1}")
            if cfg.spin.reference_logprobs == "precompute":
                precompute_reference_logprobs(dataset, built.chunks, vocab_size=vocab_size,
                                              pad_id=built.tokenizer.pad_id,
                                              pairs_per_forward=cfg.trainer.micro_batch_size)
            loader = setup.build_loader(dataset, trainer_cfg=cfg.trainer, data_parallel_size=built.data_parallel_size,
                                        seed=cfg.seed + iteration, shuffle=cfg.data.shuffle,
                                        pad_id=built.tokenizer.pad_id, pad_to_multiple_of=cfg.data.pad_to_multiple_of,
                                        collate_fn=collate_preferences)
            if cfg.spin.reference_logprobs == "swap":
                # LoRA: the base is frozen, so the iteration's reference differs from the model by its adapters only
                select = lora.is_adapter_key if built.peft_meta is not None else None
                reference = HostWeights.snapshot(built.chunks, select)
                loader = SwappedReferenceLoader(loader, built.chunks, reference, vocab_size)
            trainer.objective = DPOObjective(dpo_section(cfg.spin, beta), vocab_size)
            trainer.train_loader = loader
            trainer.metrics.write(f"SPIN iteration {iteration + 1}/{len(self.betas)}: beta={beta}, {len(pairs)} pairs, "
                                  f"{self_match:.1%} of the model's responses equal the demonstration")
            trainer.metrics.log(trainer.step, {"self_match": self_match, "iteration": iteration + 1}, prefix="spin")
            for microbatches in loader.iterate(0, epochs=1):  # resumable only before an iteration's first step
                loop.step(partial(trainer.train_step, microbatches), extra={"iteration": iteration + 1, "beta": beta},
                          resumable=trainer.step % cfg.spin.steps_per_iteration == 0,
                          unsaved_reason=self._stop_mid_iteration_reason(iteration))
            # Saved only at iteration ends, the points a run can resume from: at the first one on or
            # after each multiple of save_interval (the loop saves the end, with checkpoint.save_at_end).
            interval, start = cfg.checkpoint.save_interval, trainer.step - cfg.spin.steps_per_iteration
            if iteration + 1 < len(self.betas) and interval > 0 and trainer.step // interval > start // interval:
                trainer.save()


def build_spin_run(cfg: SPINConfig) -> SPINRun:
    """Runtime, tokenizer, model, demonstrations, optimizer and schedule, metrics: a run ready to `fit()`."""
    spin = cfg.spin
    iteration_betas(spin)
    if not cfg.data.train:
        raise ConfigError("data.train is empty: give the SFT demonstrations as {path} entries")
    built = setup.build_training_model(
        parallel=cfg.parallel, precision=cfg.precision, seed=cfg.seed, model=cfg.model, tokenizer=cfg.tokenizer,
        optim=cfg.optim, save_dir=cfg.checkpoint.save_dir, resume=cfg.checkpoint.resume,
        lock_wait_s=cfg.checkpoint.lock_wait_s, peft=cfg.peft,
        sequence_lengths=cfg.sequence_lengths(),
    )
    demonstrations = []
    for entry in cfg.data.train:
        loaded = load_demonstrations(entry.path, built.tokenizer, cfg.data.max_seq_length, cfg.data.chat_template)
        get_logger().info(f"{entry.path}: {len(loaded)} demonstrations")
        demonstrations += loaded
    total_steps = spin.num_iterations * spin.steps_per_iteration
    model_cfg = built.model_cfg
    trainer = setup.build_trainer(
        cfg, built, DPOObjective(dpo_section(spin, iteration_betas(spin)[0]), model_cfg.vocab_size),
        total_steps=total_steps,
        length_settings={"spin.num_iterations": spin.num_iterations,
                         "spin.steps_per_iteration": spin.steps_per_iteration},
    )
    metrics = trainer.metrics
    if built.resume_checkpoint is not None:
        trainer.resume_from(built.resume_checkpoint)
        if trainer.step % spin.steps_per_iteration:
            raise ConfigError(f"{built.resume_checkpoint}: step {trainer.step} is not at the end of a SPIN iteration "
                              f"(spin.steps_per_iteration={spin.steps_per_iteration}); SPIN resumes only from its "
                              "iteration-end checkpoints. Use another checkpoint.save_dir or checkpoint.resume=false")
    metrics.write(
        f"{cfg.name}: {spin.num_iterations} iterations x {spin.steps_per_iteration} steps of "
        f"{cfg.trainer.global_batch_size} pairs, betas {iteration_betas(spin)}, "
        f"{'greedy' if spin.generation.greedy else 'sampled'} self-play, {len(demonstrations)} demonstrations, "
        f"TP={cfg.parallel.tensor_model_parallel_size} PP={cfg.parallel.pipeline_model_parallel_size} "
        f"DP={built.data_parallel_size}"
    )
    return SPINRun(cfg, trainer, built, demonstrations)
