"""Building an RL actor run: `build_rl_actor` and the pieces it builds (teacher, PTX data, generation engine
and router, reward source, critic client) from an `RLActorConfig`."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from aligner import checkpointing
from aligner.algorithms.rl_actor import RLActor
from aligner.algorithms.rl_config import CriticSection, GenerationSection, RewardSection, RLActorConfig
from aligner.algorithms.rl_episodes import Environments, episodes_at_once
from aligner.algorithms.rl_objective import PolicyObjective
from aligner.clients.critic import CriticClient
from aligner.clients.reward import RewardClient
from aligner.config import ConfigError, describe_preset
from aligner.data.sft import SFTDataset
from aligner.generation.native import NativeEngine
from aligner.generation.rewards import RewardServerSource, RuleRewardSource
from aligner.generation.rollouts import PromptDataset, first_prompt_record
from aligner.generation.router_client import DynamicRouter, StaticRouter
from aligner.generation.trtllm import TensorRTLLMEngine
from aligner.hf.sources import resolve_model_source
from aligner.models import lora
from aligner.models.gpt import GPTConfig, build_model_chunks, num_parameters
from aligner.models.weight_swap import HostWeights
from aligner.tokenizer import Tokenizer
from aligner.training import setup
from aligner.training.metrics import get_logger


def build_rl_actor(cfg: RLActorConfig, *, critic=None, reward_source=None) -> RLActor:
    """Runtime, policy + reference weights, prompts, engine, router, reward source, critic client (when
    the estimator needs values), PTX data, EMA copy, optimizer and schedule; resumed from the newest
    checkpoint in checkpoint.save_dir if there is one.

    critic / reward_source: objects with the client interfaces (`CriticClient`, `score_async`);
    None builds them from the config (tests pass in-process ones).
    """
    loss = cfg.loss
    if reward_source is None and cfg.reward.source != "combined":
        # First: a reward function that cannot load or fails on the first prompt record fails in seconds.
        reward_source = build_reward_source(cfg.reward, probe_prompts=cfg.data.prompts)
    overrides = {"hidden_dropout": 0.0, "attention_dropout": 0.0} if loss.disable_dropout else None
    peft = dataclasses.replace(cfg.peft, dropout=0.0) if loss.disable_dropout else cfg.peft
    teacher_from = None  # resolved before the policy's layout is set up (an HF/GGUF teacher is imported at TP=1)
    if cfg.measures_kl and cfg.teacher.init_from is not None:
        teacher_from = resolve_model_source(cfg.teacher.init_from, "teacher.init_from", get_logger().info)
    built = setup.build_training_model(
        parallel=cfg.parallel, precision=cfg.precision, seed=cfg.seed, model=cfg.model, tokenizer=cfg.tokenizer,
        optim=cfg.optim, save_dir=cfg.checkpoint.save_dir, resume=cfg.checkpoint.resume,
        lock_wait_s=cfg.checkpoint.lock_wait_s, model_overrides=overrides,
        peft=peft, sequence_lengths=cfg.sequence_lengths(),
    )
    cfg.validate(built.data_parallel_size)
    chunks, model_cfg, tokenizer, resume = built.chunks, built.model_cfg, built.tokenizer, built.resume_checkpoint
    # The reference policy is the starting policy, also when resuming (the chunks then hold random
    # init until the resume load, so the starting weights are loaded first, copied, then replaced).
    # A run that never measures the KL never reads it: no host copy of the weights. With LoRA it is
    # the base, i.e. the live model with its adapters off: no copy either.
    reference = teacher = None
    if teacher_from is not None:
        teacher = build_teacher(teacher_from, cfg.parallel, built, cfg.sequence_lengths())
    elif cfg.measures_kl and built.peft_meta is not None:
        reference = lora.BaseReference()
    elif cfg.measures_kl:
        if resume is not None:
            lora.load_merged(built.init_from, chunks)
        reference = HostWeights.snapshot(chunks)
    ema = None
    if cfg.ema.decay is not None:
        if resume is not None:
            ema_checkpoint = Path(cfg.checkpoint.save_dir) / "ema" / resume.name
            if not ema_checkpoint.exists():
                raise checkpointing.CheckpointError(f"resuming {resume} with ema.decay set, but its EMA copy "
                                                    f"{ema_checkpoint} is missing")
            checkpointing.load(ema_checkpoint, chunks)
        ema = HostWeights.snapshot(chunks)  # the starting policy, or the saved EMA when resuming

    prompts = PromptDataset(cfg.data.prompts, tokenizer, cfg.data.max_prompt_length, cfg.data.chat_template)
    validation = None
    if cfg.data.validation_prompts:
        validation = PromptDataset(cfg.data.validation_prompts, tokenizer, cfg.data.max_prompt_length,
                                   cfg.data.chat_template)
    engine, router = build_engine_and_router(cfg.generation, chunks, model_cfg, tokenizer, cfg.data.max_prompt_length,
                                             max_sequence_length=cfg.sequence_lengths()[0][0],
                                             with_router=not cfg.rollout.episodes)
    if critic is None and cfg.uses_critic:
        critic = build_critic_client(cfg.critic)
    ptx_loader = build_ptx_loader(cfg, tokenizer)

    trainer_cfg = cfg.trainer
    minibatches_per_step = cfg.rollouts_per_step // trainer_cfg.global_batch_size
    objective = PolicyObjective(model_cfg.vocab_size,
                                cfg.generation.temperature if loss.scale_logits_by_temperature else 1.0, loss,
                                cfg.clip_high, cfg.constant_normalizer, cfg.ptx.coef if cfg.ptx.data else 0.0)
    # Steps are rollout rounds; the LR schedule counts optimizer steps (epochs x minibatches per step).
    policy = setup.build_trainer(cfg, built, objective, total_steps=trainer_cfg.max_steps,
                                 optimizer_steps=trainer_cfg.max_steps * loss.epochs * minibatches_per_step)
    environments = None
    if cfg.rollout.episodes:  # the sandbox workers; the environment loads (or its tools are described), or one line
        environments = Environments.build(cfg.rollout, episodes_at_once(cfg, built.data_parallel_size))
    try:
        trainer = RLActor(cfg, policy=policy, reference=reference, engine=engine, router=router,
                          reward_source=reward_source, critic=critic if cfg.uses_critic else None, prompts=prompts,
                          validation_prompts=validation, ptx_loader=ptx_loader, tokenizer=tokenizer,
                          model_cfg=model_cfg, metrics=policy.metrics, ema=ema, teacher=teacher,
                          environments=environments)
        if resume is not None:
            trainer.resume_from(resume)
    except BaseException:
        if environments is not None:  # no worker process outlives a run that could not start
            environments.pool.close()
        raise
    for prompt_set in (prompts, validation):
        if prompt_set is not None and prompt_set.skipped_note:
            policy.metrics.write(f"warning: {prompt_set.skipped_note}")
    preset = describe_preset(cfg)
    if preset is not None:
        policy.metrics.write(preset)
    rollout = cfg.rollout
    policy.metrics.write(
        f"{cfg.name}: {num_parameters(model_cfg) / 1e6:.2f}M parameters, layout "
        f"TP={cfg.parallel.tensor_model_parallel_size} PP={cfg.parallel.pipeline_model_parallel_size} "
        f"DP={built.data_parallel_size}; {len(prompts)} prompts ({prompts.too_long} longer than "
        f"{cfg.data.max_prompt_length} tokens skipped); "
        + (f"teacher {teacher_from} ({num_parameters(teacher[1]) / 1e6:.2f}M parameters) as the reference; "
           if teacher is not None else
           f"reference policy {built.init_from} on host memory ({reference.num_bytes / 2**20:.1f} MiB); "
           if isinstance(reference, HostWeights) else
           "reference policy: the base model with the LoRA adapters off (no copy); " if reference is not None
           else "no reference policy (fixed KL coefficient 0); ")
        + f"{rollout.prompts_per_step} prompts x {rollout.samples_per_prompt} "
        f"samples per step{' (dynamic sampling)' if rollout.dynamic_sampling else ''}; advantages "
        f"{cfg.advantage.estimator}{' with the critic server' if cfg.uses_critic else ''}, loss {loss.policy_loss} "
        f"({loss.aggregation}); {loss.epochs} epoch(s) of {minibatches_per_step} minibatch(es)")
    return trainer


def build_teacher(init_from: Path, parallel, built, sequence_lengths: list[tuple[int, str]]) -> tuple:
    """(chunks, GPTConfig) of the teacher at the policy's layout and precision, in eval mode. Refused unless
    its tokenizer is the policy's (the teacher scores the policy's token ids) and its positions hold the
    rollouts (`RLActorConfig.sequence_lengths`)."""
    teacher_cfg = GPTConfig.from_dict(checkpointing.read_meta(init_from)["model"])
    teacher_cfg.check_sequence_lengths(sequence_lengths,
                                       f"teacher.init_from={init_from}'s model.max_position_embeddings")
    tokenizer_dir = Path(init_from) / checkpointing.TOKENIZER_DIR
    if not tokenizer_dir.is_dir() or Tokenizer(tokenizer_dir).hf.get_vocab() != built.tokenizer.hf.get_vocab():
        raise ConfigError(f"teacher.init_from={init_from}: its tokenizer ({tokenizer_dir}) is not the policy's; "
                          "on-policy distillation needs one tokenizer (the teacher scores the policy's token ids)")
    chunks = build_model_chunks(teacher_cfg, parallel, built.params_dtype)
    lora.load_for_inference(init_from, chunks)
    for chunk in chunks:
        chunk.eval()
        for param in chunk.parameters():
            param.requires_grad = False
    return chunks, teacher_cfg


def build_ptx_loader(cfg: RLActorConfig, tokenizer):
    """The PTX data's loader (SFT-format micro batches), or None when ptx.data is null."""
    if cfg.ptx.data is None:
        return None
    from megatron.core import parallel_state as ps

    seq_length = cfg.data.max_prompt_length + cfg.generation.max_new_tokens
    if cfg.ptx.max_seq_length > seq_length + 1:
        raise ConfigError(f"ptx.max_seq_length={cfg.ptx.max_seq_length} must be at most data.max_prompt_length + "
                          f"generation.max_new_tokens + 1 = {seq_length + 1}: PTX and policy micro batches share one "
                          "sequence length in the pipeline schedule")
    ptx_set = SFTDataset(cfg.ptx.data, tokenizer, cfg.ptx.max_seq_length, use_template=cfg.data.chat_template)
    return setup.build_loader(ptx_set, trainer_cfg=cfg.trainer, data_parallel_size=ps.get_data_parallel_world_size(),
                              seed=cfg.seed, shuffle=True, pad_id=tokenizer.pad_id, pad_to_multiple_of=1)


def build_engine_and_router(gen: GenerationSection, chunks, model_cfg, tokenizer, max_prompt_length: int,
                            max_sequence_length: Optional[int] = None, with_router: bool = True):
    """The generation engine on this replica and the router that hands it prompts (collective; None without
    with_router: episodes go to the engine directly). max_sequence_length: the engine's, prompt + new tokens
    (default: max_prompt_length + gen.max_new_tokens)."""
    from megatron.core import parallel_state as ps

    seq_length = max_sequence_length or max_prompt_length + gen.max_new_tokens
    if gen.engine == "native":
        engine = NativeEngine(chunks, model_cfg, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
                              max_batch_size=gen.micro_batch_size, max_sequence_length=seq_length,
                              decode=tokenizer.decode)
    else:
        engine = TensorRTLLMEngine(model_cfg, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
                                   work_dir=Path(gen.trtllm_work_dir) / f"replica_{ps.get_data_parallel_rank()}",
                                   max_batch_size=gen.micro_batch_size, max_input_len=max_prompt_length,
                                   max_sequence_length=seq_length)
    if not with_router:
        router = None
    elif gen.router == "dynamic":
        router = DynamicRouter(micro_batch_size=gen.micro_batch_size, data_parallel_group=ps.get_data_parallel_group(),
                               model_parallel_group=ps.get_model_parallel_group(), port=gen.router_port)
    else:
        router = StaticRouter(micro_batch_size=gen.micro_batch_size, data_parallel_group=ps.get_data_parallel_group())
    return engine, router


def build_reward_source(section: RewardSection, probe_prompts: Optional[str] = None):
    """What scores responses (source server or function; combined: the critic server sends them); the
    section's RewardChecks check their scores. Reward functions are called once on the first record of
    the prompt file `probe_prompts` (when given) with the response "": one that fails there ends the run
    before anything else is built."""
    if section.source == "environment":  # the episodes' environment gives the rewards
        return None
    if section.source == "function":
        source = RuleRewardSource(section)
        if probe_prompts is not None:
            record, prompt, columns = first_prompt_record(probe_prompts)
            source.probe(prompt, columns, record)
        return source
    server = section.server
    return RewardServerSource(RewardClient(server.host, server.port, server.model_name, timeout_s=server.timeout_s,
                                           ready_timeout_s=server.ready_timeout_s), section.attribute_index, section)


def build_critic_client(section: CriticSection):
    server = section.server
    return CriticClient(server.host, server.port, infer_model=server.model_name, timeout_s=server.timeout_s,
                        ready_timeout_s=server.ready_timeout_s)
