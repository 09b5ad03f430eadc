"""The tiny end-to-end alignment pipeline on CPU (`make demo`).

Stages, each the same command a user would run (`--stages` re-runs a subset on earlier artefacts; `--jobs`, default 2,
runs that many side by side, each after the stages it reads, their output in results/demo/logs/):
  sft            data (arithmetic problems; the demonstrations systematically forget the carry), a
                 character tokenizer, a random-init model ("before"), SFT ("after")
  reward_models  a reward model on preference pairs (pairwise accuracy) and a SteerLM attribute
                 model (correlation with held-out labels)
  ppo            critic server (started from the reward model) + PPO actor through launch_ppo.py,
                 rewarded by the task's checker
  dpo            DPO (+ NLL on the chosen answer) on the preference pairs, with full weights and with LoRA
  kto            KTO on the same pairs taken apart into desirable and undesirable examples
  rs             rejection sampling: best of 4 sampled answers, kept when the checker says right, SFT on them
  kd             knowledge distillation: a smaller random-init student on the demonstrations with the DPO
                 model's top-4 logits, against the same student trained by SFT alone
  spin           SPIN on correct demonstrations
  steerlm        annotate demonstrations with the served attribute model, attribute-conditioned SFT,
                 then ask for the top and a low correctness
  group_rl       RLOO, GRPO, Dr. GRPO, DAPO and GSPO: the same actor with each one's settings, 8 samples
                 per prompt, rewarded by the task's checker; then GRPO at half the lr twice, synchronous
                 and asynchronous (a generation worker one step ahead)
  agentic        long additions (3-4 digits) with a calculator tool: its own data, tokenizer and SFT
                 (demonstrations that call the calculator sometimes, else answer with the forgotten
                 carries), then GRPO from that SFT model twice with the same settings: single-turn, and
                 with rollout.tools=[calculator] (episodes); held-out accuracy of each, the tool calls
                 per episode and how the episodes ended
The SFT model learns the demonstrators' habit: right without a carry, mostly wrong with one. The
summary table shows how far each alignment method closes that gap on held-out problems.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

from aligner.agents.episode import EPISODE_STATUSES
from aligner.checkpointing import latest_checkpoint
from aligner.config import run_main
from aligner.demo import stages
from aligner.demo.intervals import format_interval
from aligner.runtime.distributed import PRECISIONS
from aligner.runtime.errors import ConfigError
from aligner.training.metrics import read_metrics

REPO_ROOT = Path(__file__).resolve().parents[2]
GPT_EXAMPLES = REPO_ROOT / "examples" / "nlp" / "gpt"
DATA_SCRIPTS = REPO_ROOT / "examples" / "nlp" / "data" / "arithmetic"
STEERLM_SCRIPTS = REPO_ROOT / "examples" / "nlp" / "data" / "steerlm"

# The demo model and schedule (sized for ~2 minutes of SFT on 2 CPU cores).
SFT_OVERRIDES = [
    "data.max_seq_length=32",
    "data.split='100,0'",
    "trainer.max_steps=1000",
    "trainer.global_batch_size=128",
    "trainer.micro_batch_size=128",
    "trainer.val_check_interval=250",
    "optim.lr=1e-3",
    "optim.min_lr=1e-4",
    "optim.warmup_steps=20",
    "logging.log_interval=100",
]


# Reward models start from the SFT checkpoint; ~1000 steps is where they learn to check carries.
RM_OVERRIDES = [
    "data.max_seq_length=32",
    "trainer.max_steps=1000",
    "trainer.global_batch_size=64",
    "trainer.micro_batch_size=64",
    "trainer.val_check_interval=250",
    "optim.lr=1e-3",
    "optim.min_lr=1e-4",
    "optim.warmup_steps=20",
    "logging.log_interval=250",
    "checkpoint.resume=false",
]


# PPO: 40 steps of 128 rollouts, 4 epochs on each, critic server started from the reward model.
PPO_CRITIC_PORT = 5760
PPO_ACTOR_OVERRIDES = [
    "data.max_prompt_length=8",
    "generation.max_new_tokens=6",
    "generation.micro_batch_size=64",
    "rollout.prompts_per_step=128",
    "loss.epochs=4",
    "trainer.global_batch_size=128",
    "trainer.micro_batch_size=64",
    "trainer.max_steps=40",
    "trainer.val_check_interval=0",
    "critic.warmup_steps=2",
    "kl.init_coef=0.01",
    "optim.lr=5e-5",
    "checkpoint.save_interval=0",
    "logging.log_interval=10",
]
PPO_CRITIC_OVERRIDES = [
    "train.global_batch_size=128",
    "train.micro_batch_size=128",
    "train.clip_val=null",
    "optim.lr=3e-4",
    "inference.micro_batch_size=64",
]

# The group methods: 20 steps of 64 prompts x 8 samples in two minibatches (two updates per step, so each
# method's ratio clipping acts), no KL, each with its preset (algorithm=NAME: aligner.algorithms.rl_config.ALGORITHMS)
# plus the extra settings listed in GROUP_RL_RUNS. Chosen over three SFT seeds (examples/demo/demo_seeds.py;
# docs/results/demo.md): with 4 samples an SFT model that rarely carries leaves most carry groups uniformly wrong
# (advantage 0); at lr 2e-4 the policy gave back the no-carry answers.
GROUP_RL_OVERRIDES = [
    "data.max_prompt_length=8",
    "generation.max_new_tokens=6",
    "generation.micro_batch_size=128",
    "rollout.prompts_per_step=64",
    "rollout.samples_per_prompt=8",
    "trainer.global_batch_size=256",
    "trainer.micro_batch_size=128",
    "optim.lr=1e-4",
    "kl.init_coef=0.0",
    "trainer.max_steps=20",
    "trainer.val_check_interval=0",
    "checkpoint.save_interval=0",
    "checkpoint.resume=false",
]

ASYNC_RL_SETTINGS = ("rollout.asynchronous.enabled=true", "rollout.asynchronous.max_staleness=1",
                     "loss.importance_sampling=token")
GROUP_RL_RUNS = [  # (the run's directory and evaluation name, table row, its settings after GROUP_RL_OVERRIDES)
    ("rloo", "RLOO", ("algorithm=rloo",)),
    ("grpo", "GRPO", ("algorithm=grpo",)),
    ("dr_grpo", "Dr. GRPO", ("algorithm=dr_grpo",)),
    # overlong shaping: the longest right answer is 4 tokens (198 + eos); 5 tokens cost 0.5, 6 cost 1
    ("dapo", "DAPO", ("algorithm=dapo", "reward.overlong_buffer=2")),
    ("gspo", "GSPO", ("algorithm=gspo",)),
    # Asynchronous RL (docs/guides/async_rl.md): a generation worker on one core samples the next step's
    # rollouts while the trainer updates on the other, one version behind (max_staleness 1), corrected by
    # token-level truncated importance weights. At the lr above one update moves this policy 0.04-0.4 nats per
    # token and one-step-old rollouts lost 2-13 points; at half of it both runs kept their accuracy (three seeds),
    # so the pair runs at 5e-5, the synchronous run beside the asynchronous one.
    ("grpo_lr5e-5", "GRPO, lr 5e-5", ("algorithm=grpo", "optim.lr=5e-5")),
    ("grpo_async", "GRPO, lr 5e-5, asynchronous", ("algorithm=grpo", "optim.lr=5e-5", *ASYNC_RL_SETTINGS)),
]

# DPO from the SFT checkpoint; the NLL term on the chosen answer keeps the right answers likely
# (plain DPO lowers both likelihoods and made this model worse).
DPO_OVERRIDES = [
    "data.max_seq_length=32",
    "trainer.max_steps=120",
    "trainer.global_batch_size=64",
    "trainer.micro_batch_size=64",
    "trainer.val_check_interval=0",
    "optim.lr=5e-4",
    "optim.min_lr=5e-5",
    "optim.warmup_steps=10",
    "dpo.beta=0.1",
    "dpo.sft_loss_weight=1.0",
    "dpo.reference_logprobs=swap",
    "logging.log_interval=50",
    "checkpoint.resume=false",
]

# The same DPO run with LoRA adapters (rank 16 on every linear; base frozen and the reference), at the
# learning rate adapters need.
DPO_LORA_OVERRIDES = ["peft.scheme=lora", "peft.rank=16", "peft.alpha=32", "optim.lr=5e-3", "optim.min_lr=5e-4"]

# KTO on the preference pairs taken apart: each right answer a desirable example, each wrong one an
# undesirable example (no pairing left for the loss to use).
KTO_OVERRIDES = [
    "data.max_seq_length=32",
    "trainer.max_steps=120",
    "trainer.global_batch_size=64",
    "trainer.micro_batch_size=32",
    "trainer.val_check_interval=0",
    "optim.lr=5e-4",
    "optim.min_lr=5e-5",
    "optim.warmup_steps=10",
    "kto.beta=0.1",
    "kto.sft_loss_weight=1.0",
    "kto.reference_logprobs=precompute",
    "logging.log_interval=50",
    "checkpoint.resume=false",
]

# Rejection sampling: best of 4 answers per prompt, only right ones kept (the checker's score 1), SFT on them.
RS_OVERRIDES = [
    "data.max_prompt_length=8",
    "rs.num_iterations=4",
    "rs.prompts_per_iteration=1024",
    "rs.samples_per_prompt=4",
    "rs.min_score=1.0",
    "rs.epochs_per_iteration=2",
    "rs.generation.max_new_tokens=6",
    "rs.generation.batch_size=256",
    "trainer.global_batch_size=64",
    "trainer.micro_batch_size=64",
    "optim.lr=5e-4",
    "optim.min_lr=5e-5",
    "optim.warmup_steps=10",
    "logging.log_interval=25",
    "checkpoint.resume=false",
]

# Knowledge distillation: a smaller student (2 layers x 64, random init) trained on the SFT demonstrations,
# once with the aligned DPO model's top-4 logits at every answer position (KD) and once by SFT alone.
STUDENT_ARCHITECTURE = [
    "model.architecture.num_layers=2",
    "model.architecture.hidden_size=64",
    "model.architecture.num_attention_heads=4",
    "model.architecture.num_query_groups=2",
    "model.architecture.ffn_hidden_size=256",
]
STUDENT_OVERRIDES = [
    "data.max_seq_length=32",
    "data.split='100,0'",
    "trainer.max_steps=1500",
    "trainer.global_batch_size=128",
    "trainer.micro_batch_size=128",
    "trainer.val_check_interval=0",
    "optim.lr=2e-3",
    "optim.min_lr=2e-4",
    "optim.warmup_steps=20",
    "logging.log_interval=200",
    "checkpoint.resume=false",
]

# SPIN on correct demonstrations (on the careless ones it can only learn their habit), 2 iterations.
SPIN_OVERRIDES = [
    "data.max_seq_length=32",
    "spin.generation.max_new_tokens=6",
    "spin.num_iterations=2",
    "spin.steps_per_iteration=60",
    "spin.kl_betas=[0.1]",
    "spin.sft_loss_weight=1.0",
    "spin.reference_logprobs=precompute",
    "trainer.global_batch_size=64",
    "trainer.micro_batch_size=64",
    "optim.lr=5e-4",
    "optim.min_lr=5e-5",
    "optim.warmup_steps=10",
    "logging.log_interval=25",
]

# SteerLM: 10,000 demonstrations annotated by the attribute model, 300 steps of conditioned SFT.
STEERLM_SERVER_PORT = 5781
STEERLM_SFT_OVERRIDES = [
    "data.max_seq_length=32",
    "data.split='100,0'",
    "trainer.max_steps=300",
    "trainer.global_batch_size=128",
    "trainer.micro_batch_size=128",
    "trainer.val_check_interval=0",
    "optim.lr=1e-3",
    "optim.min_lr=1e-4",
    "optim.warmup_steps=10",
    "logging.log_interval=100",
    "checkpoint.resume=false",
]


# The agentic stage (aligner/demo/long_addition.py): its own SFT from random init on 64-token conversations, then
# GRPO single-turn and GRPO with the calculator from that checkpoint with the same settings. A call is
# `CALL calculate {"expression": "1234+5678"}` (44 tokens with its end), so a turn may generate 48 tokens; an
# episode is the prompt (11), the call, the tool's answer and the final answer (~70 tokens). 600 SFT steps: at 300
# the model's calls miscopied the operands (docs/results/demo.md, "The agentic stage").
AGENTIC_SFT_OVERRIDES = [
    "data.max_seq_length=72",
    "data.split='100,0'",
    "trainer.max_steps=600",
    "trainer.global_batch_size=64",
    "trainer.micro_batch_size=64",
    "trainer.val_check_interval=0",
    "optim.lr=1e-3",
    "optim.min_lr=1e-4",
    "optim.warmup_steps=20",
    "logging.log_interval=100",
]
AGENTIC_RL_OVERRIDES = [
    "algorithm=grpo",
    "data.max_prompt_length=12",
    "generation.max_new_tokens=48",
    "generation.micro_batch_size=128",
    "rollout.prompts_per_step=32",
    "rollout.samples_per_prompt=8",
    "trainer.global_batch_size=256",
    "trainer.micro_batch_size=128",
    "optim.lr=1e-4",
    "kl.init_coef=0.0",
    "trainer.max_steps=10",
    "trainer.val_check_interval=0",
    "checkpoint.save_interval=0",
    "checkpoint.resume=false",
]
AGENTIC_DATA_ARGS: list[str] = []  # make_tool_data.py's sizes (default: 20,000 SFT conversations, 500 held out)
AGENTIC_EVAL_LIMIT = None  # held-out problems evaluated (None: all 500)
# The tool runs: plain-format calls (the toy model's), at most 3 model turns, a few sandbox workers for the
# calculator (a call is short; a worker per episode would be 256 processes).
AGENTIC_TOOL_OVERRIDES = [
    "rollout.tools=[calculator]",
    "rollout.tool_call_format=plain",
    "rollout.max_turns=3",
    "rollout.max_episode_tokens=128",
    "rollout.sandbox.workers=4",
]


def run(stage: str, command: list) -> None:
    """One command of a stage, from the repository root (its output: the console, or the stage's log)."""
    stages.run(stage, command, REPO_ROOT)


def evaluate(stage: str, checkpoint: Path, prompts: Path, output: Path, temperature: float = 0.0,
             extra: tuple = ()) -> dict:
    run(stage, [sys.executable, "-m", "aligner.demo.evaluate", "--checkpoint", checkpoint, "--prompts", prompts,
                "--temperature", str(temperature), "--output", output, *extra])
    return json.loads(output.read_text())


def evaluate_reward_model(stage: str, checkpoint: Path, flag: str, data_file: Path, output: Path) -> dict:
    run(stage, [sys.executable, "-m", "aligner.demo.evaluate", "--checkpoint", checkpoint, flag, data_file,
                "--output", output])
    return json.loads(output.read_text())


def format_agentic_table(table: list[tuple[str, dict]]) -> str:
    """The agentic stage's table: held-out accuracy [95 % interval], tool calls per episode, how episodes ended."""
    width = max((len(name) for name, _ in table), default=24) + 2
    lines = [f"{'long additions':<{width}}{'accuracy [95 % interval]':>26}{'tool calls/episode':>20}  statuses"]
    for name, result in table:
        overall = format_interval(result["all"], result["num_carry"] + result["num_no_carry"])
        if "tool_calls" in result:
            calls = f"{result['tool_calls']:.2f} ({result['tool_calls_ok']:.2f} ok)"
            statuses = ", ".join(f"{status} {result[status]:.1%}" for status in EPISODE_STATUSES if result[status])
        else:
            calls = "-"
            statuses = f"one turn; replies that are a call {result['call_replies']:.1%}"
        lines.append(f"{name:<{width}}{overall:>26}{calls:>20}  {statuses}")
    return "\n".join(lines)


def format_table(table: list[tuple[str, dict]]) -> str:
    """The accuracy table: each row's held-out accuracy with its 95 % interval over the problems."""
    width = max((len(name) for name, _ in table), default=24) + 2
    lines = [f"{'model':<{width}}{'accuracy [95 % interval]':>26}{'carry':>10}{'no carry':>10}"]
    for name, result in table:
        overall = format_interval(result["all"], result["num_carry"] + result["num_no_carry"])
        lines.append(f"{name:<{width}}{overall:>26}{result['carry']:>10.1%}{result['no_carry']:>10.1%}")
    return "\n".join(lines)


class Demo:
    """The pipeline's stages; each one reads what earlier stages wrote under `work` (so a stage can be
    re-run alone with --stages) and adds rows to the accuracy table."""

    def __init__(self, work: Path, args):
        self.work, self.args = work, args
        self.data, self.tokenizer = work / "data", work / "data" / "tokenizer"
        self.heldout = self.data / "heldout_prompts.jsonl"
        # each stage's rows and notes apart (stages may run side by side); the summary prints them in STAGES order
        self.rows: dict[str, list[tuple[str, dict]]] = defaultdict(list)
        self.agentic_table: list[tuple[str, dict]] = []
        self.notes: dict[str, list[str]] = defaultdict(list)
        self.timings: dict[str, float] = {}
        # Every training run's precision and seed (data order, sampling); evaluation stays as it is.
        self.run_settings = [f"precision={args.precision}", *([] if args.seed is None else [f"seed={args.seed}"])]

    @property
    def sft_checkpoint(self) -> Path:
        return self._earlier_stage_checkpoint("sft", self.work / "sft" / "checkpoints")

    @property
    def rm_checkpoint(self) -> Path:
        return self._earlier_stage_checkpoint("reward_models", self.work / "reward_model" / "checkpoints")

    @property
    def attribute_rm_checkpoint(self) -> Path:
        return self._earlier_stage_checkpoint("reward_models", self.work / "attribute_reward_model" / "checkpoints")

    @staticmethod
    def _earlier_stage_checkpoint(stage: str, save_dir: Path) -> Path:
        found = latest_checkpoint(save_dir)
        if found is None:
            raise ConfigError(f"no checkpoint under {save_dir}: run the '{stage}' stage first "
                              f"(--stages {stage},...) with the same --workdir")
        return found

    def greedy(self, name: str, checkpoint: Path, extra: tuple = ()) -> dict:
        result = evaluate(f"evaluate {name}", checkpoint, self.heldout, self.work / f"eval_{name}.json", extra=extra)
        return result

    # -- 1-4: data, tokenizer, random init, SFT
    def sft(self) -> None:
        run("data", [sys.executable, DATA_SCRIPTS / "make_data.py", "--out-dir", self.data, "--seed", "0"])
        run("tokenizer", [sys.executable, DATA_SCRIPTS / "train_tokenizer.py", "--data-dir", self.data,
                          "--out-dir", self.tokenizer])
        common = [f"tokenizer.path={self.tokenizer}", f"data.train=[{{path: {self.data / 'sft_train.jsonl'}}}]",
                  f"data.validation=[{{path: {self.data / 'sft_validation.jsonl'}}}]", *SFT_OVERRIDES,
                  *self.run_settings]
        if self.args.sft_steps is not None:
            common.append(f"trainer.max_steps={self.args.sft_steps}")
        init, sft_dir = self.work / "init", self.work / "sft"
        # The demo owns its workdir: a re-run replaces the stage's earlier output, whose checkpoints a
        # run with checkpoint.resume=false would refuse to share a save_dir with.
        for stage_dir in (init, sft_dir):
            shutil.rmtree(stage_dir, ignore_errors=True)
        run("init", [sys.executable, GPT_EXAMPLES / "train_gpt_sft.py", *common, "trainer.max_steps=0",
                     f"checkpoint.save_dir={init}", f"logging.log_dir={init}", "checkpoint.resume=false"])
        self.rows["sft"].append(("random init", self.greedy("init", init / "step_00000000")))
        run("sft", [sys.executable, GPT_EXAMPLES / "train_gpt_sft.py", *common,
                    f"model.init_from={init / 'step_00000000'}", f"checkpoint.save_dir={sft_dir / 'checkpoints'}",
                    f"logging.log_dir={sft_dir}", "checkpoint.resume=false"])
        self.rows["sft"].append(("SFT", self.greedy("sft", self.sft_checkpoint)))
        sampled = evaluate("evaluate sft (sampled)", self.sft_checkpoint, self.heldout,
                           self.work / "eval_sft_sampled.json", temperature=1.0)
        self.rows["sft"].append(("SFT, sampled at T=1", sampled))
        train_losses = [row["loss"] for row in read_metrics(sft_dir, "train", newest_attempt=True)]
        self.notes["sft"].append(f"SFT loss: {train_losses[0]:.3f} at step 1 -> "
                                 f"{train_losses[-1]:.3f} at step {len(train_losses)}")

    # -- 5-6: reward models
    def reward_models(self) -> None:
        rm_steps = [] if self.args.rm_steps is None else [f"trainer.max_steps={self.args.rm_steps}"]
        rm_dir, attribute_dir = self.work / "reward_model", self.work / "attribute_reward_model"
        for stage_dir in (rm_dir, attribute_dir):  # replaced on a re-run, as in sft()
            shutil.rmtree(stage_dir, ignore_errors=True)
        run("reward model", [sys.executable, GPT_EXAMPLES / "train_reward_model.py",
                             f"model.init_from={self.sft_checkpoint}",
                             f"data.train=[{{path: {self.data / 'preference_train.jsonl'}}}]",
                             f"data.validation=[{{path: {self.data / 'preference_validation.jsonl'}}}]", *RM_OVERRIDES,
                             *rm_steps, *self.run_settings, f"checkpoint.save_dir={rm_dir / 'checkpoints'}",
                             f"logging.log_dir={rm_dir}"])
        rm_result = evaluate_reward_model("evaluate reward model", self.rm_checkpoint, "--comparisons",
                                          self.data / "preference_validation.jsonl", self.work / "eval_rm.json")
        self.notes["reward_models"].append(f"reward model: held-out pairwise accuracy {rm_result['accuracy']:.1%} "
                                           f"({rm_result['pairs']} pairs)")
        run("attribute reward model", [
            sys.executable, GPT_EXAMPLES / "train_reward_model.py", f"model.init_from={self.sft_checkpoint}",
            "reward.type=regression", "reward.attributes=[correctness]", "reward.normalize=false",
            f"data.train=[{{path: {self.data / 'attributes_train.jsonl'}}}]",
            f"data.validation=[{{path: {self.data / 'attributes_validation.jsonl'}}}]", *RM_OVERRIDES, *rm_steps,
            *self.run_settings,
            f"checkpoint.save_dir={attribute_dir / 'checkpoints'}", f"logging.log_dir={attribute_dir}"])
        attribute_result = evaluate_reward_model("evaluate attribute reward model", self.attribute_rm_checkpoint,
                                                 "--attributes", self.data / "attributes_validation.jsonl",
                                                 self.work / "eval_attribute_rm.json")
        correlations = ", ".join(f"{name} {value:.3f}" for name, value in attribute_result.items())
        self.notes["reward_models"].append(f"attribute reward model: Pearson correlation with held-out labels "
                                           f"{correlations}")

    # -- 7: PPO (critic server + actor through the launcher; the reward is the task's checker)
    def ppo(self) -> None:
        ppo_dir = self.work / "ppo"
        shutil.rmtree(ppo_dir, ignore_errors=True)
        actor = [f"model.init_from={self.sft_checkpoint}", f"data.prompts={self.data / 'rl_prompts.jsonl'}",
                 "reward.function=aligner.demo.arithmetic:score_response", *PPO_ACTOR_OVERRIDES, *self.run_settings]
        run("ppo", [sys.executable, GPT_EXAMPLES / "launch_ppo.py", "--reward", "function",
                    "--critic-checkpoint", self.rm_checkpoint, "--log-dir", ppo_dir,
                    "--critic-port", str(PPO_CRITIC_PORT),
                    *[f"--actor-arg={arg}" for arg in actor],
                    *[f"--critic-arg={arg}" for arg in [*PPO_CRITIC_OVERRIDES, *self.run_settings]]])
        self.rows["ppo"].append(("PPO", self.greedy("ppo", latest_checkpoint(ppo_dir / "actor" / "checkpoints"))))

    # -- 8: DPO on the preference pairs (the reward model's training data)
    def dpo(self) -> None:
        out = self.work / "dpo"
        shutil.rmtree(out, ignore_errors=True)
        run("dpo", [sys.executable, GPT_EXAMPLES / "train_gpt_dpo.py", f"model.init_from={self.sft_checkpoint}",
                    f"data.train=[{{path: {self.data / 'preference_train.jsonl'}}}]",
                    f"data.validation=[{{path: {self.data / 'preference_validation.jsonl'}}}]", *DPO_OVERRIDES,
                    *self.run_settings, f"checkpoint.save_dir={out / 'checkpoints'}", f"logging.log_dir={out}"])
        self.rows["dpo"].append(("DPO", self.greedy("dpo", latest_checkpoint(out / "checkpoints"))))
        out = self.work / "dpo_lora"
        shutil.rmtree(out, ignore_errors=True)
        run("dpo lora", [sys.executable, GPT_EXAMPLES / "train_gpt_dpo.py", f"model.init_from={self.sft_checkpoint}",
                         f"data.train=[{{path: {self.data / 'preference_train.jsonl'}}}]",
                         f"data.validation=[{{path: {self.data / 'preference_validation.jsonl'}}}]", *DPO_OVERRIDES,
                         *DPO_LORA_OVERRIDES, *self.run_settings, f"checkpoint.save_dir={out / 'checkpoints'}",
                         f"logging.log_dir={out}"])
        # (the evaluation loads the adapter checkpoint onto its base: lora.load_for_inference)
        self.rows["dpo"].append(("DPO, LoRA rank 16", self.greedy("dpo_lora", latest_checkpoint(out / "checkpoints"))))

    # -- KTO on the preference pairs taken apart
    def kto(self) -> None:
        out = self.work / "kto"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        files = {}
        for split in ("train", "validation"):
            pairs = [json.loads(line) for line in (self.data / f"preference_{split}.jsonl").read_text().splitlines()]
            files[split] = out / f"unpaired_{split}.jsonl"
            files[split].write_text("".join(
                json.dumps({"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}) + "\n"
                for pair in pairs for side in ("chosen", "rejected")))
        run("kto", [sys.executable, GPT_EXAMPLES / "train_gpt_kto.py", f"model.init_from={self.sft_checkpoint}",
                    f"data.train=[{{path: {files['train']}}}]", f"data.validation=[{{path: {files['validation']}}}]",
                    *KTO_OVERRIDES, *self.run_settings, f"checkpoint.save_dir={out / 'checkpoints'}",
                    f"logging.log_dir={out}"])
        self.rows["kto"].append(("KTO", self.greedy("kto", latest_checkpoint(out / "checkpoints"))))

    # -- rejection sampling (best of n, the task's checker as the score)
    def rs(self) -> None:
        out = self.work / "rs"
        shutil.rmtree(out, ignore_errors=True)
        run("rejection sampling", [
            sys.executable, GPT_EXAMPLES / "train_gpt_rs.py", f"model.init_from={self.sft_checkpoint}",
            f"data.prompts={self.data / 'rl_prompts.jsonl'}", "reward.source=function",
            "reward.function=aligner.demo.arithmetic:score_response", *RS_OVERRIDES, *self.run_settings,
            f"checkpoint.save_dir={out / 'checkpoints'}", f"logging.log_dir={out}"])
        self.rows["rs"].append(("rejection sampling, best of 4",
                                self.greedy("rs", latest_checkpoint(out / "checkpoints"))))

    # -- knowledge distillation from the DPO model into a smaller student, against SFT alone
    def kd(self) -> None:
        teacher = self._earlier_stage_checkpoint("dpo", self.work / "dpo" / "checkpoints")
        out = self.work / "kd"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        data, topk = self.data / "sft_train.jsonl", out / "sft_train.topk.safetensors"
        run("kd teacher pass", [sys.executable, DATA_SCRIPTS.parent / "compute_teacher_topk.py", f"teacher={teacher}",
                                f"data.path={data}", "data.max_seq_length=32", "top_k=4", "micro_batch_size=256",
                                f"output={topk}"])
        common = [f"tokenizer.path={self.tokenizer}", *STUDENT_ARCHITECTURE, *STUDENT_OVERRIDES, *self.run_settings]
        run("kd student", [sys.executable, GPT_EXAMPLES / "train_gpt_knowledge_distillation.py", *common,
                           f"data.train=[{{path: {data}, teacher_topk: {topk}}}]",
                           f"checkpoint.save_dir={out / 'student' / 'checkpoints'}",
                           f"logging.log_dir={out / 'student'}"])
        run("kd student by SFT alone", [sys.executable, GPT_EXAMPLES / "train_gpt_sft.py", *common,
                                        f"data.train=[{{path: {data}}}]",
                                        f"checkpoint.save_dir={out / 'sft_student' / 'checkpoints'}",
                                        f"logging.log_dir={out / 'sft_student'}"])
        self.rows["kd"].append(("student (2x64), distilled from DPO",
                           self.greedy("kd_student", latest_checkpoint(out / "student" / "checkpoints"))))
        self.rows["kd"].append(("student (2x64), SFT alone",
                           self.greedy("sft_student", latest_checkpoint(out / "sft_student" / "checkpoints"))))

    # -- 9: SPIN (self-play against the demonstrations)
    def spin(self) -> None:
        out = self.work / "spin"
        shutil.rmtree(out, ignore_errors=True)
        run("spin", [sys.executable, GPT_EXAMPLES / "train_gpt_spin.py", f"model.init_from={self.sft_checkpoint}",
                     f"data.train=[{{path: {self.data / 'sft_correct_train.jsonl'}}}]", *SPIN_OVERRIDES,
                     *self.run_settings, f"checkpoint.save_dir={out / 'checkpoints'}", f"logging.log_dir={out}"])
        self.rows["spin"].append(("SPIN", self.greedy("spin", latest_checkpoint(out / "checkpoints"))))

    # -- 11: the group methods (no critic; k samples per prompt), each the same actor with its preset
    def group_rl(self) -> None:
        for name, label, settings in GROUP_RL_RUNS:
            out = self.work / name
            shutil.rmtree(out, ignore_errors=True)
            run(label, [sys.executable, GPT_EXAMPLES / "train_gpt_reinforce_actor.py",
                        f"model.init_from={self.sft_checkpoint}", f"data.prompts={self.data / 'rl_prompts.jsonl'}",
                        "reward.source=function", "reward.function=aligner.demo.arithmetic:score_response",
                        *GROUP_RL_OVERRIDES, *settings, *self.run_settings,
                        f"checkpoint.save_dir={out / 'checkpoints'}", f"logging.log_dir={out}"])
            self.rows["group_rl"].append((label, self.greedy(name, latest_checkpoint(out / "checkpoints"))))

    # -- 10: SteerLM (annotate with the served attribute model, attribute-conditioned SFT, steer)
    def steerlm(self) -> None:
        out = self.work / "steerlm"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        annotated = out / "sft_annotated.jsonl"
        with open(out / "server.log", "w") as server_log:
            server = stages.spawn(
                [sys.executable, GPT_EXAMPLES / "serve_reward_model.py", f"init_from={self.attribute_rm_checkpoint}",
                 "normalize_rewards=false", f"server.port={STEERLM_SERVER_PORT}", "inference.micro_batch_size=256",
                 "server.max_batch_size=256"], REPO_ROOT, stdout=server_log)
            try:
                run("steerlm annotate", [sys.executable, STEERLM_SCRIPTS / "annotate.py", "--input",
                                         self.data / "sft_train.jsonl", "--output", annotated,
                                         "--attributes", "correctness", "--scale", "0:4",
                                         "--port", str(STEERLM_SERVER_PORT), "--limit", "10000",
                                         "--batch-size", "256", "--max-in-flight", "4", "--ready-timeout", "180"])
            finally:
                server.terminate()
                server.wait(timeout=60)
                stages.release(server)
        run("steerlm sft", [sys.executable, GPT_EXAMPLES / "train_gpt_sft.py", f"model.init_from={self.sft_checkpoint}",
                            f"data.train=[{{path: {annotated}}}]", "data.steerlm.attributes=[correctness]",
                            "data.steerlm.format=values", *STEERLM_SFT_OVERRIDES, *self.run_settings,
                            f"checkpoint.save_dir={out / 'checkpoints'}", f"logging.log_dir={out}"])
        checkpoint = latest_checkpoint(out / "checkpoints")
        self.rows["steerlm"].append(("SteerLM, correctness=4",
                           self.greedy("steerlm_top", checkpoint, ("--steer", "correctness=4"))))
        self.rows["steerlm"].append(("SteerLM, correctness=1",
                           self.greedy("steerlm_low", checkpoint, ("--steer", "correctness=1"))))

    # -- the agentic stage: long additions with a calculator, GRPO single-turn against GRPO with the tool
    def agentic(self) -> None:
        out = self.work / "agentic"
        shutil.rmtree(out, ignore_errors=True)
        data, tokenizer = out / "data", out / "data" / "tokenizer"
        run("agentic data", [sys.executable, DATA_SCRIPTS / "make_tool_data.py", "--out-dir", data, "--seed", "0",
                             *AGENTIC_DATA_ARGS])
        run("agentic tokenizer", [sys.executable, DATA_SCRIPTS / "train_tokenizer.py", "--data-dir", data,
                                  "--out-dir", tokenizer, "--printable"])
        common = [f"tokenizer.path={tokenizer}", f"data.train=[{{path: {data / 'sft_train.jsonl'}}}]",
                  *AGENTIC_SFT_OVERRIDES, *self.run_settings]
        run("agentic init", [sys.executable, GPT_EXAMPLES / "train_gpt_sft.py", *common, "trainer.max_steps=0",
                             f"checkpoint.save_dir={out / 'init'}", f"logging.log_dir={out / 'init'}",
                             "checkpoint.resume=false"])
        run("agentic sft", [sys.executable, GPT_EXAMPLES / "train_gpt_sft.py", *common,
                            f"model.init_from={out / 'init' / 'step_00000000'}",
                            f"checkpoint.save_dir={out / 'sft' / 'checkpoints'}", f"logging.log_dir={out / 'sft'}",
                            "checkpoint.resume=false"])
        sft = latest_checkpoint(out / "sft" / "checkpoints")
        heldout = data / "heldout_prompts.jsonl"

        def evaluate_tools(name: str, checkpoint: Path, tools: bool) -> dict:
            output = out / f"eval_{name}.json"
            run(f"evaluate {name}", [sys.executable, "-m", "aligner.demo.tool_eval", "--checkpoint", checkpoint,
                                     "--prompts", heldout, "--output", output, *(["--tools"] if tools else []),
                                     *([] if AGENTIC_EVAL_LIMIT is None else ["--limit", str(AGENTIC_EVAL_LIMIT)])])
            return json.loads(output.read_text())

        self.agentic_table.append(("SFT, one turn", evaluate_tools("sft_one_turn", sft, tools=False)))
        self.agentic_table.append(("SFT, with the calculator", evaluate_tools("sft_tools", sft, tools=True)))
        for name, label, extra, tools in (("grpo_one_turn", "GRPO single-turn", [], False),
                                          ("grpo_tools", "GRPO with the calculator", AGENTIC_TOOL_OVERRIDES, True)):
            run(label, [sys.executable, GPT_EXAMPLES / "train_gpt_reinforce_actor.py", f"model.init_from={sft}",
                        f"data.prompts={data / 'rl_prompts.jsonl'}", "reward.source=function",
                        "reward.function=aligner.demo.long_addition:score_response", *AGENTIC_RL_OVERRIDES, *extra,
                        *self.run_settings, f"checkpoint.save_dir={out / name / 'checkpoints'}",
                        f"logging.log_dir={out / name}"])
            self.agentic_table.append(
                (label, evaluate_tools(name, latest_checkpoint(out / name / "checkpoints"), tools)))

    @property
    def table(self) -> list[tuple[str, dict]]:
        return [row for stage in STAGES for row in self.rows.get(stage, ())]

    def summary(self, started: float, jobs: int, threads: int) -> None:
        print("\n=== demo summary (held-out problems, never trained on; greedy decoding unless noted)")
        for stage in STAGES:
            for note in self.notes.get(stage, ()):
                print(note)
        if self.table:
            print(format_table(self.table))
        if self.agentic_table:
            print(format_agentic_table(self.agentic_table))
        print("stage times: " + ", ".join(f"{name} {self.timings[name]:.0f} s" for name in STAGES
                                          if name in self.timings)
              + (f" ({jobs} at a time, {threads} thread(s) each)" if jobs > 1 else ""))
        print(f"total time {time.perf_counter() - started:.0f} s; artefacts in {self.work}")


STAGES = ("sft", "reward_models", "ppo", "dpo", "kto", "rs", "kd", "spin", "steerlm", "group_rl", "agentic")
# The stages each one reads the artefacts of (run before it when both are chosen).
DEPENDS = {"reward_models": ("sft",), "ppo": ("reward_models",), "dpo": ("sft",), "kto": ("sft",), "rs": ("sft",),
           "kd": ("dpo",), "spin": ("sft",), "steerlm": ("reward_models",), "group_rl": ("sft",)}
# Which ready stage starts first with --jobs > 1: the longest chains first (sft -> reward models -> PPO and SteerLM,
# sft -> DPO -> distillation) and the agentic stage, which needs nothing, beside SFT. On 2 cores the stages then end
# within a minute of each other.
SCHEDULE = ("sft", "agentic", "reward_models", "dpo", "kd", "group_rl", "ppo", "steerlm", "kto", "spin", "rs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="results/demo")
    parser.add_argument("--sft-steps", type=int, default=None, help="override the SFT step count (quick runs)")
    parser.add_argument("--rm-steps", type=int, default=None, help="override the reward-model step counts (quick runs)")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated subset of {','.join(STAGES)} "
                             "(later stages reuse earlier ones' artefacts)")
    parser.add_argument("--seed", type=int, default=None,
                        help="every training run's seed (data order, sampling); default: each yaml's")
    parser.add_argument("--precision", default="auto", choices=PRECISIONS,
                        help="every training run's precision (auto: fp32 on CPU; bf16 is fast on CPUs with "
                             "AVX512-BF16/AMX)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="stages run side by side, each with OMP_NUM_THREADS (default: the cores) / JOBS "
                             "threads; 1: one after the other, output as it comes (default: %(default)s)")
    args = parser.parse_args()
    chosen = [stage.strip() for stage in args.stages.split(",") if stage.strip()]
    unknown = sorted(set(chosen) - set(STAGES))
    if unknown:
        parser.error(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give at least 1")
    threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    jobs = min(args.jobs, threads)
    demo = Demo((REPO_ROOT / args.workdir).resolve(), args)
    started = time.perf_counter()
    graph = stages.StageGraph({name: getattr(demo, name) for name in SCHEDULE if name in chosen}, DEPENDS, jobs=jobs,
                              threads=max(1, threads // jobs), log_dir=demo.work / "logs")
    demo.timings = graph.run()
    demo.summary(started, jobs, max(1, threads // jobs))


if __name__ == "__main__":
    run_main(main)
