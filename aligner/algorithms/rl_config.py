"""The RL actor's config schema: its sections, `RLActorConfig` (aligner/conf/gpt_ppo_actor.yaml,
aligner/conf/gpt_reinforce_actor.yaml, both extending gpt_rl_actor.yaml), `GroupRLActorConfig`, and the
algorithm presets `ALGORITHMS` (aligner/conf/algorithms/NAME.yaml).

An algorithm is a choice of registered pure functions (README, "RL algorithms"); `algorithm=NAME` sets
one preset's keys under the keys the user sets (`aligner.config.load_config`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from aligner.agents.environment import BAD_CALL_POLICIES
from aligner.agents.rollout import FAILURE_POLICIES, EpisodeLimits
from aligner.agents.tool_calls import TOOL_CALL_FORMATS
from aligner.clients.protocol import CRITIC_INFER_MODEL, REWARD_MODEL
from aligner.config import CONF_DIR, ConfigError, at_least, load_presets, one_of
from aligner.data.records import Layouts
from aligner.data.sft import SFT_LAYOUTS
from aligner.generation.rewards import RewardFunctionSettings
from aligner.generation.rollouts import PROMPT_LAYOUTS
from aligner.generation.worker import parse_address, worker_key
from aligner.models.gpt import ACTIVATION_RECOMPUTE
from aligner.models.packing import SharedPromptPackingSection
from aligner.rl import advantages, mismatch, policy_losses, shaping
from aligner.training.metrics import LoggingConfig
from aligner.training.setup import RunConfig

# The settings that make each algorithm, one yaml file per preset (aligner/conf/algorithms/NAME.yaml, which users
# can read and copy): `algorithm=NAME` on either RL entry point sets them (under the user's explicit keys, see
# aligner.config.load_config); README's table shows them. Each preset names every key that tells the algorithms
# apart, so it means the same whatever the config file set before it. ppo needs the critic server
# (train_gpt_ppo_actor.py / launch_ppo.py). DAPO's overlong shaping (reward.overlong_buffer) depends on
# generation.max_new_tokens and is left to the user.
ALGORITHMS: dict[str, dict[str, object]] = load_presets(CONF_DIR / "algorithms")


# ----------------------------------------------------------------------------- config schema
@dataclass
class ServerAddress:
    host: str = "127.0.0.1"
    port: int = 5555
    model_name: str = REWARD_MODEL
    timeout_s: float = 300.0  # one request, queueing included
    ready_timeout_s: float = 120.0  # how long the first request waits for the server to come up


@dataclass
class RewardSection(RewardFunctionSettings):
    # server: a reward-model server | combined: the critic server in combined mode (rewards come back with
    # the values, one request) | function: Python functions (function / functions: RewardFunctionSettings'
    # keys) | environment: the episodes' environment gives every reward (rollout.environment). The score checks
    # (timeout_s, max_abs, on_invalid, invalid_value) are RewardChecks'.
    source: str = one_of(("server", "combined", "function", "environment"), "server")
    server: ServerAddress = field(default_factory=ServerAddress)
    attribute_index: int = 0  # which output of a multi-attribute reward model is the reward
    # Score shaping, in this order:
    missing_stop_penalty: Optional[float] = None  # score of a response that never stopped; null: off
    normalization_mean: Optional[float] = None  # scores -> (score - mean) / std; null: off
    normalization_std: float = 1.0
    clip: Optional[float] = None  # scores clamped to [-clip, clip]; null: off
    overlong_buffer: Optional[int] = None  # DAPO: the last this many tokens before max_new_tokens cost up to
    overlong_penalty: float = 1.0  # ... this much, linearly (soft overlong punishment); null buffer: off

    def __post_init__(self):
        if self.source == "critic":  # the combined mode's old name on the actor's side
            print("deprecated: reward.source=critic is now reward.source=combined (the old name goes in the next "
                  "release)", file=sys.stderr)
            self.source = "combined"


@dataclass
class CriticSection:
    # model_name: the server's inference model; its other models are named critic_train/critic_save/critic_restore
    server: ServerAddress = field(default_factory=lambda: ServerAddress(port=5560, model_name=CRITIC_INFER_MODEL))
    # rollout rounds in which only the critic trains, before the actor's first update
    warmup_steps: int = at_least(0, 0)


@dataclass
class GenerationSection:
    engine: str = one_of(("native", "trtllm"), "native")  # trtllm: GPU clusters, optional extra
    max_new_tokens: int = at_least(1, 32)
    # stop tokens are masked until this many tokens (truncation after a minimum length)
    min_new_tokens: int = at_least(0, 0)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    fixed_length: bool = False  # keep sampling past the stop token (OpenAI's original setting)
    stop_strings: list = field(default_factory=list)
    micro_batch_size: int = at_least(1, 16)  # rollouts per router hand-out (episodes: per run); the engine's cache rows
    router: str = one_of(("dynamic", "static"), "dynamic")  # dynamic: a shared queue (slow ranks take fewer)
    # the dynamic router's queue: a TCP port global rank 0 listens on ($MASTER_ADDR, else 127.0.0.1)
    router_port: int = at_least(0, 0, "0: a free port")
    trtllm_work_dir: str = "results/trtllm"


@dataclass
class KLSection:
    estimator: str = one_of(shaping.KL_ESTIMATORS, "k1")  # per-token KL penalty in the reward
    adaptive: bool = False  # Ziegler et al.'s controller; false: fixed coefficient init_coef
    init_coef: float = 0.05
    target: float = 6.0  # adaptive: KL per sequence to steer towards
    horizon: float = 10000.0  # adaptive: samples over which the error is corrected


@dataclass
class SandboxSection:
    """The worker processes environments and tools run in (aligner/runtime/sandbox.py)."""

    # worker processes per rank; null: one per episode a rank runs at once (generation.micro_batch_size, at most the
    # rank's prompts_per_step / DP x samples_per_prompt), which an environment needs (each episode's instance lives
    # in a worker); tools need fewer
    workers: Optional[int] = None
    timeout_s: float = 10.0  # one call (a reset, a step, a tool call): its worker is killed past it
    memory_mb: int = at_least(64, 2048)  # address space of a worker
    processes: int = at_least(1, 32)  # processes a worker may have
    network: bool = False  # true: environment code may use the network


@dataclass
class AsynchronousSection:
    """Generation in a worker process of its own, overlapping training (docs/guides/async_rl.md)."""

    enabled: bool = False
    # How many weight versions the policy that sampled a consumed rollout may lag the trainer's: step s is sent
    # to the worker once it holds the weights of step s - max_staleness. 0: the synchronous run, bit for bit.
    max_staleness: int = at_least(0, 1)
    # torch threads of the worker; null: half the trainer's (at least 1), the trainer keeping the rest
    worker_threads: Optional[int] = at_least(1, None, "null: half the trainer's threads")
    silence_timeout_s: float = at_least(1.0, 600.0)  # the worker says nothing this long while awaited: stalled
    weight_timeout_s: float = at_least(1.0, 120.0)  # one weight copy in the worker, once started
    restarts: int = at_least(0, 1)  # a worker that dies or stalls is started again this many times, then the run stops
    # "host:port" of generation worker servers (examples/nlp/gpt/serve_generation_worker.py), n per data-parallel
    # rank (rank r's: the r-th n of the list), which split its share of each step; empty: a worker process beside
    # each rank
    workers: list = field(default_factory=list)


@dataclass
class RolloutSection:
    prompts_per_step: int = at_least(1, 64)  # distinct prompts per step over all data-parallel ranks
    samples_per_prompt: int = at_least(1, 1)  # k samples of each prompt (a group); rollouts per step = prompts x k
    dynamic_sampling: bool = False  # DAPO: drop groups whose k scores are equal, draw more prompts until full
    max_sampling_rounds: int = at_least(1, 4)  # dynamic sampling: generation rounds per step at most
    # Multi-turn episodes (docs/guides/agents.md): an environment, or tools, make every rollout an episode.
    environment: Optional[str] = None  # "package.module:Class" | "file.py:Class" | a built-in name; null: single-turn
    environment_args: dict = field(default_factory=dict)  # the environment class's keyword arguments
    tools: list = field(default_factory=list)  # without an environment: functions offered as tools ("module:fn")
    tool_call_format: str = one_of(tuple(TOOL_CALL_FORMATS), "hermes")
    max_parallel_calls: int = at_least(1, 1)  # tool calls per reply; more are answered with an error
    # a bad tool call (malformed, unknown tool, bad arguments): feedback (the error is the tool's answer) | end
    # (the episode ends, reward 0) | fixed_advantage (it ends, and its tokens get bad_call_advantage)
    on_bad_call: str = one_of(BAD_CALL_POLICIES, "feedback")
    bad_call_advantage: float = -1.0
    chat_template: Optional[str] = None  # a training template (Jinja text) in place of the tokenizer's; null: its own
    max_turns: int = at_least(1, EpisodeLimits.max_turns)
    max_episode_tokens: int = at_least(2, EpisodeLimits.max_episode_tokens)  # prompt included: the trained row
    max_observation_tokens: int = at_least(1, EpisodeLimits.max_observation_tokens)  # longer: cut in the middle
    episode_timeout_s: float = EpisodeLimits.episode_timeout_s
    on_failure: str = one_of(FAILURE_POLICIES, EpisodeLimits.on_failure)  # an environment that fails
    on_cut_turn: str = one_of(("continue", "end"), EpisodeLimits.on_cut_turn)
    sandbox: SandboxSection = field(default_factory=SandboxSection)
    asynchronous: AsynchronousSection = field(default_factory=AsynchronousSection)

    @property
    def episodes(self) -> bool:
        return self.environment is not None or bool(self.tools)

    def limits(self) -> EpisodeLimits:
        return EpisodeLimits(self.max_turns, self.max_episode_tokens, self.max_observation_tokens,
                             self.episode_timeout_s, self.on_failure, self.on_cut_turn)


@dataclass
class AdvantageSection:
    estimator: str = one_of(tuple(advantages.ADVANTAGE_ESTIMATORS), "gae")
    gamma: float = 1.0  # gae, reinforce_plus_plus
    lam: float = 0.95  # gae
    whiten_advantages: bool = True  # gae: masked, with the statistics of the global batch (across DP)
    whiten_rewards: bool = False  # gae: per-token rewards scaled to unit variance (mean kept)
    group_std: bool = True  # grpo: divide the scores (not the KL penalty) by the group's score std
    std_eps: float = 1.0e-6


@dataclass
class LossSection:
    policy_loss: str = one_of(tuple(policy_losses.POLICY_LOSSES), "ppo_clip")
    clip_ratio: float = 0.2  # ratio clip: [1 - clip_ratio, 1 + clip_high]
    clip_high: Optional[float] = None  # upper clip (DAPO's clip-higher, e.g. 0.28); null: clip_ratio
    aggregation: str = one_of(policy_losses.AGGREGATIONS, "token_mean")
    constant_normalizer: Optional[int] = None  # constant_sum: tokens per response it divides by; null: max_new_tokens
    entropy_coef: float = 0.0  # entropy bonus
    epochs: int = at_least(1, 1)  # passes over each step's rollouts; minibatch = trainer.global_batch_size responses
    importance_sampling: str = one_of(("none",) + mismatch.TIS_LEVELS, "none")  # truncated IS against the engine
    importance_sampling_cap: float = 2.0
    scale_logits_by_temperature: bool = True  # logprobs of logits / sampling temperature
    recompute_old_logprobs: bool = True  # false: use the engine's logprobs as the rollout policy's
    # With one update per step (one epoch, one minibatch) and nothing that reads the rollout policy's
    # logprobs before it (no KL, no importance sampling), the update's own forward runs on the rollout
    # weights: its logprobs, detached, are the recomputed ones, so no separate pass (TRL does the same).
    old_logprobs_from_update: bool = True
    disable_dropout: bool = True
    adam_epsilon_style: str = one_of(("torch", "tf"), "torch")  # tf: epsilon outside the bias correction


@dataclass
class PTXSection:
    data: Optional[str] = None  # SFT data (any format) for the pretraining/next-token loss mixture; null: off
    coef: float = 0.0
    max_seq_length: int = 512


@dataclass
class EMASection:
    decay: Optional[float] = None  # e.g. 0.992; an EMA copy of the actor saved beside it; null: off


@dataclass
class RLDataSection:
    prompts: str = "???"  # JSONL/Parquet/Arrow/datasets dir, {"prompt": text or [{"role", "content"}, ...]} per record
    validation_prompts: Optional[str] = None
    max_prompt_length: int = at_least(1, 64)
    shuffle: bool = True
    chat_template: bool = True  # render prompts with the tokenizer's chat template (if it has one)

    def sources(self) -> list[tuple[str, Optional[str]]]:
        return [("data.prompts", self.prompts), ("data.validation_prompts", self.validation_prompts)]


@dataclass
class PolicySection:
    init_from: str = "???"  # the starting policy (an SFT checkpoint); also the reference policy
    activation_recompute: str = one_of(ACTIVATION_RECOMPUTE, "none")  # as setup.ModelSection's


@dataclass
class TeacherSection:
    """On-policy distillation: a teacher model takes the reference policy's place (the KL penalty and metric
    are then the reverse KL to it). It may be larger than the policy or of another architecture; it must
    share the policy's tokenizer."""

    init_from: Optional[str] = None  # the teacher checkpoint (an adapter checkpoint loads onto its base); null: none


@dataclass
class RLLoggingConfig(LoggingConfig):
    # Sample completions (prompt, response, reward) on the console, truncated, and as a TensorBoard text table:
    # at the first step, every this many steps and the last step
    samples_interval: int = at_least(0, 10, "0: off")
    num_samples: int = at_least(0, 2)  # completions shown each time
    sample_chars: int = at_least(16, 160)  # the console shows at most this many characters of a prompt or response


def _renamed_update_keys(section: str) -> tuple:
    """The old `ppo.*` / `reinforce.*` keys and where they live now."""
    moved = {
        "prompts_per_step": "rollout.prompts_per_step", "samples_per_prompt": "rollout.samples_per_prompt",
        "epochs": "loss.epochs", "clip_ratio": "loss.clip_ratio", "entropy_coef": "loss.entropy_coef",
        "loss_aggregation": "loss.aggregation", "scale_logits_by_temperature": "loss.scale_logits_by_temperature",
        "recompute_old_logprobs": "loss.recompute_old_logprobs", "disable_dropout": "loss.disable_dropout",
        "adam_epsilon_style": "loss.adam_epsilon_style", "gamma": "advantage.gamma", "lam": "advantage.lam",
        "whiten_advantages": "advantage.whiten_advantages", "whiten_rewards": "advantage.whiten_rewards",
        "reward_normalization_mean": "reward.normalization_mean",
        "reward_normalization_std": "reward.normalization_std", "reward_clip": "reward.clip",
        "missing_stop_penalty": "reward.missing_stop_penalty", "baseline": "advantage.estimator",
        "normalize_by_group_std": "advantage.group_std", "std_eps": "advantage.std_eps",
    }
    return tuple((f"{section}.{old}", new) for old, new in moved.items())


@dataclass
class RLActorConfig(RunConfig):
    """aligner/conf/gpt_ppo_actor.yaml, aligner/conf/gpt_reinforce_actor.yaml. trainer.global_batch_size = responses per
    minibatch (optimizer step); trainer.max_steps = rollout rounds; trainer.limit_val_samples = validation prompts."""

    LR_METHOD = "rl"  # its row in aligner/training/lr_ranges.py
    RENAMED_KEYS: ClassVar[tuple] = _renamed_update_keys("ppo") + _renamed_update_keys("reinforce")
    PRESETS: ClassVar[tuple] = ("algorithm", ALGORITHMS)

    name: str = "gpt_rl_actor"
    algorithm: Optional[str] = None  # a preset of ALGORITHMS (ppo | rloo | grpo | ...); null: the file's settings
    model: PolicySection = field(default_factory=PolicySection)
    data: RLDataSection = field(default_factory=RLDataSection)
    generation: GenerationSection = field(default_factory=GenerationSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    advantage: AdvantageSection = field(default_factory=AdvantageSection)
    loss: LossSection = field(default_factory=LossSection)
    kl: KLSection = field(default_factory=KLSection)
    reward: RewardSection = field(default_factory=RewardSection)
    critic: CriticSection = field(default_factory=CriticSection)
    ptx: PTXSection = field(default_factory=PTXSection)
    ema: EMASection = field(default_factory=EMASection)
    teacher: TeacherSection = field(default_factory=TeacherSection)
    packing: SharedPromptPackingSection = field(default_factory=SharedPromptPackingSection)
    logging: RLLoggingConfig = field(default_factory=RLLoggingConfig)

    @property
    def rollouts_per_step(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.samples_per_prompt

    @property
    def uses_critic(self) -> bool:
        return advantages.ADVANTAGE_ESTIMATORS[self.advantage.estimator].needs_values

    @property
    def measures_kl(self) -> bool:
        """Whether a step runs the reference policy: not for a fixed KL coefficient of 0, whose penalty
        is 0 whatever the reference says (the pass would cost a forward over every rollout)."""
        return self.kl.adaptive or self.kl.init_coef != 0

    @property
    def old_logprobs_in_update(self) -> bool:
        """Whether the rollout policy's logprobs are taken from the update's forward (`LossSection`)."""
        loss = self.loss
        return (loss.recompute_old_logprobs and loss.old_logprobs_from_update and loss.disable_dropout
                and loss.epochs == 1 and self.trainer.global_batch_size == self.rollouts_per_step
                and not self.measures_kl and loss.importance_sampling == "none")

    @property
    def clip_high(self) -> float:
        return self.loss.clip_ratio if self.loss.clip_high is None else self.loss.clip_high

    @property
    def constant_normalizer(self) -> float:
        value = self.loss.constant_normalizer
        return float(self.response_width if value is None else value)

    @property
    def sequence_length(self) -> int:
        """The trained rows' length: a prompt + its response, or an episode (rollout.max_episode_tokens)."""
        if self.rollout.episodes:
            return self.rollout.max_episode_tokens
        return self.data.max_prompt_length + self.generation.max_new_tokens

    @property
    def response_width(self) -> int:
        """Columns of the per-token tensors: a response's tokens, or all of an episode's after its prompt."""
        return self.rollout.max_episode_tokens - 1 if self.rollout.episodes else self.generation.max_new_tokens

    @property
    def sequence_length_key(self) -> str:
        if self.rollout.episodes:
            return "rollout.max_episode_tokens"
        return "data.max_prompt_length + generation.max_new_tokens"

    def data_layouts(self) -> Layouts:
        return PROMPT_LAYOUTS

    def data_sources(self) -> list[tuple[str, Optional[str], Optional[Layouts]]]:
        return super().data_sources() + [("ptx.data", self.ptx.data, SFT_LAYOUTS)]

    def sequence_lengths(self) -> list[tuple[int, str]]:
        # A rollout: a prompt + its response, or an episode (the PTX rows are at most this long:
        # `build_ptx_loader`). The engine holds an episode and one more turn's tokens while it generates.
        if self.rollout.episodes:
            episode, new = self.rollout.max_episode_tokens, self.generation.max_new_tokens
            return [(episode + new, f"rollout.max_episode_tokens + generation.max_new_tokens = {episode} + {new} = "
                                    f"{episode + new}")]
        prompt, new = self.data.max_prompt_length, self.generation.max_new_tokens
        return [(prompt + new, f"data.max_prompt_length + generation.max_new_tokens = {prompt} + {new} = "
                               f"{prompt + new}")]

    def validate(self, data_parallel_size: int) -> None:
        """Checks across sections (single values are checked when the config loads)."""
        rollout, loss, gen, trainer = self.rollout, self.loss, self.generation, self.trainer
        estimator = advantages.ADVANTAGE_ESTIMATORS[self.advantage.estimator]
        k = rollout.samples_per_prompt
        if k < estimator.min_group_size:
            raise ConfigError(f"rollout.samples_per_prompt={k}: advantage.estimator={estimator.name} needs at least "
                              f"{estimator.min_group_size} samples per prompt")
        if self.teacher.init_from is not None and not self.measures_kl:
            raise ConfigError("teacher.init_from is read through the KL term: set a KL coefficient > 0 (kl.init_coef)")
        if estimator.name == "on_policy_distillation" and (self.teacher.init_from is None or not self.measures_kl):
            raise ConfigError("advantage.estimator=on_policy_distillation learns from the reverse KL to a teacher: set "
                              "teacher.init_from and a KL coefficient > 0 (kl.init_coef)")
        if rollout.dynamic_sampling and k < 2:
            raise ConfigError("rollout.dynamic_sampling drops groups whose samples scored alike: it needs "
                              "rollout.samples_per_prompt >= 2")
        if trainer.max_epochs is not None:
            raise ConfigError("RL actors count rollout steps: set trainer.max_steps and leave trainer.max_epochs null")
        if rollout.prompts_per_step % data_parallel_size:
            raise ConfigError(f"rollout.prompts_per_step={rollout.prompts_per_step} must be a multiple of the "
                              f"data-parallel size {data_parallel_size} (each rank trains on whole prompt groups)")
        per_rank = self.rollouts_per_step // data_parallel_size
        minibatch_per_rank, remainder = divmod(trainer.global_batch_size, data_parallel_size)
        if remainder or minibatch_per_rank == 0 or per_rank % minibatch_per_rank:
            raise ConfigError(f"trainer.global_batch_size={trainer.global_batch_size} (responses per minibatch) "
                              f"must be a multiple of the data-parallel size {data_parallel_size} and divide the "
                              f"{self.rollouts_per_step} rollouts per step (rollout.prompts_per_step x "
                              "rollout.samples_per_prompt)")
        if minibatch_per_rank % trainer.micro_batch_size:
            raise ConfigError(f"trainer.micro_batch_size={trainer.micro_batch_size} must divide the per-rank "
                              f"minibatch {minibatch_per_rank}")
        if not loss.clip_ratio > 0 or not self.clip_high > 0:
            raise ConfigError(f"loss.clip_ratio={loss.clip_ratio} and loss.clip_high={loss.clip_high} must be > 0")
        if not loss.scale_logits_by_temperature and not loss.recompute_old_logprobs:
            raise ConfigError("the engine's logprobs are temperature-scaled: "
                              "with loss.scale_logits_by_temperature=false set loss.recompute_old_logprobs=true")
        self.packing.check_layout(self.parallel.pipeline_model_parallel_size, self.sequence_length,
                                  self.sequence_length_key, self.parallel.expert_model_parallel_size)
        if loss.importance_sampling != "none" and not loss.recompute_old_logprobs:
            raise ConfigError("loss.importance_sampling corrects the engine's logprobs towards the trainer's: it needs "
                              "loss.recompute_old_logprobs=true")
        if gen.temperature <= 0:
            raise ConfigError("the actor samples its rollouts: generation.temperature must be > 0")
        if self.reward.source == "environment" and not rollout.episodes:
            raise ConfigError("reward.source=environment takes the rewards from the episodes' environment: set "
                              "rollout.environment (or rollout.tools)")
        if self.reward.source == "function" and not self.reward.function_entries():
            raise ConfigError("reward.source=function needs reward.function='path/to/file.py:function' (or "
                              "'package.module:function', or a weighted list in reward.functions)")
        if self.reward.source == "combined" and not self.uses_critic:
            raise ConfigError(f"reward.source=combined takes the rewards from the critic server, but "
                              f"advantage.estimator={estimator.name} uses no critic: use reward.source=server")
        buffer = self.reward.overlong_buffer
        if buffer is not None and not 0 < buffer <= gen.max_new_tokens:
            raise ConfigError(f"reward.overlong_buffer={buffer} must lie in 1..generation.max_new_tokens "
                              f"({gen.max_new_tokens})")
        if self.ptx.data is not None and self.ptx.coef <= 0:
            raise ConfigError("ptx.data is set but ptx.coef is not > 0")
        if self.ema.decay is not None and not 0 < self.ema.decay < 1:
            raise ConfigError(f"ema.decay must lie in (0, 1), got {self.ema.decay}")
        row_length, longest = self.packing.row_length, self.sequence_length
        if row_length is not None and row_length < longest:
            raise ConfigError(f"packing.row_length={row_length} must hold the longest rollout: at least "
                              f"{self.sequence_length_key} = {longest}")
        if rollout.episodes:
            self.validate_episodes()
        if rollout.asynchronous.enabled:
            self.validate_asynchronous(data_parallel_size)

    def validate_asynchronous(self, data_parallel_size: int) -> None:
        """Checks of a run whose rollouts come from a generation worker (`aligner.algorithms.rl_async`)."""
        rollout, parallel, loss = self.rollout, self.parallel, self.loss
        model_parallel = parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
        if model_parallel > 1:
            raise ConfigError("rollout.asynchronous.enabled: each trainer rank holds the whole policy (TP=PP=1; any "
                              f"data-parallel size) for its generation worker; this layout splits it over "
                              f"{model_parallel} ranks")
        if rollout.asynchronous.workers:
            workers = rollout.asynchronous.workers
            if len(workers) % data_parallel_size:
                raise ConfigError(f"rollout.asynchronous.workers names {len(workers)} worker server(s) for "
                                  f"{data_parallel_size} data-parallel rank(s): give each rank as many")
            if len(workers) > data_parallel_size and rollout.episodes:
                raise ConfigError("rollout.asynchronous.workers: multi-turn episodes run on one worker per "
                                  f"data-parallel rank ({data_parallel_size}); {len(workers)} are given")
            for address in workers:
                parse_address(address, "rollout.asynchronous.workers")
            worker_key()  # before the model is built: the servers only talk to a trainer holding their key
        unsupported = [(self.generation.engine != "native", "generation.engine=native"),
                       (rollout.dynamic_sampling, "rollout.dynamic_sampling=false")]
        for unmet, needed in unsupported:
            if unmet:
                raise ConfigError(f"rollout.asynchronous.enabled needs {needed}")
        if rollout.asynchronous.max_staleness > 0 and (loss.importance_sampling == "none"
                                                       or not loss.recompute_old_logprobs):
            raise ConfigError(f"rollout.asynchronous.max_staleness={rollout.asynchronous.max_staleness} trains on "
                              "rollouts of older weights: set loss.importance_sampling=token (or sequence) and "
                              "loss.recompute_old_logprobs=true, the correction from the sampling policy to the "
                              "trainer's")

    def validate_episodes(self) -> None:
        """Checks of a run on multi-turn episodes."""
        rollout, parallel = self.rollout, self.parallel
        if rollout.environment is not None and rollout.tools:
            raise ConfigError("rollout.environment and rollout.tools are both set: an environment offers its own "
                              "tools (its reset returns them); rollout.tools builds the tool environment")
        if parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size > 1:
            raise ConfigError("rollout.environment / rollout.tools: multi-turn episodes run at tensor and pipeline "
                              "parallel size 1 (each data-parallel rank runs its own episodes)")
        if self.generation.engine != "native":
            raise ConfigError("rollout.environment / rollout.tools: multi-turn episodes run on "
                              "generation.engine=native")
        if self.reward.source == "combined":
            raise ConfigError("reward.source=combined scores single-turn rollouts with their values: with episodes "
                              "use reward.source=environment, function or server")
        if self.rollout.dynamic_sampling:
            raise ConfigError("rollout.dynamic_sampling works on single-turn rollouts only")
        if self.reward.overlong_buffer is not None:
            raise ConfigError("reward.overlong_buffer shapes single-turn responses; episodes end at "
                              "rollout.max_episode_tokens (status truncated)")
        if self.rollout.max_episode_tokens <= self.data.max_prompt_length:
            raise ConfigError(f"rollout.max_episode_tokens={rollout.max_episode_tokens} must exceed "
                              f"data.max_prompt_length={self.data.max_prompt_length} (an episode starts with its "
                              "prompt)")
        if self.ptx.data is not None:
            raise ConfigError("ptx.data mixes SFT rows into single-turn steps only")


@dataclass
class GroupRLActorConfig(RLActorConfig):
    """train_gpt_reinforce_actor.py's schema: its yaml and launch start no critic server, so algorithm=ppo is
    refused when the config loads (before its data files are read or anything is built)."""

    def check_fields(self) -> Optional[tuple[str, str]]:
        if self.algorithm == "ppo":
            return "algorithm", ("PPO trains a critic alongside the actor: use examples/nlp/gpt/train_gpt_ppo_actor.py "
                                 "(examples/nlp/gpt/launch_ppo.py starts the critic server with it)")
        return None

