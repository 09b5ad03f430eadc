"""The work both sides of a training-step comparison do, defined once, and how each side's trainer is told.

Stdlib only: the driver, our worker (the project's venv) and the TRL worker (its own venv) all import it.
`Workload` holds every setting that must be equal; `aligner_overrides` and `trl_config` translate the same
instance into our config overrides and TRL's config keyword arguments, so a setting cannot drift apart
between the sides. The data files are written once (`write_data`) and read by both sides unchanged, in
TRL's conversational form, which our loaders read too (rendered by the same chat template).

Matched: model weights (fp32, the same HF export), data records, global batch, micro batch (TRL's
per-device batch x gradient accumulation = our global batch), sequence lengths, learning rate, constant
schedule, no warm-up, Adam betas/eps, weight decay, grad clip 1.0, dropout off, threads, the process
environment (the driver's `worker_environment`: glibc's malloc settings included), and for RL:
prompts per step x samples per prompt, max new tokens (forced: both sides mask the stop token until
max_new_tokens were generated, so every rollout has the same length), temperature 1, no top-k/top-p,
KL coefficient 0 (neither side runs a reference pass), one epoch, one optimizer step per rollout step.
The rollout policy's logprobs: TRL's RLOOTrainer always recomputes them with a forward pass; TRL's
GRPOTrainer, on-policy, and our actor (`loss.old_logprobs_from_update`) take them from the update's own
forward. So `rl` (RLOO) compares each trainer as users run it, TRL doing one forward more, and `grpo`
(GRPO: group mean and std) compares two trainers that both skip that pass.
DPO: both sides run the reference forward inside every step (TRL's default; ours `reference_logprobs=swap`).

SFT: prompt/completion records, the loss on the completion's tokens on both sides (TRL's completion_only_loss;
ours: the response tokens); both workers count the positions the loss reads and the driver prints them.

Not matched (cannot be, or does not change the work): the optimizer implementation (torch AdamW vs
megatron's Adam with decoupled weight decay), padding (SFT: both pad to the longest row, ours on CPU;
DPO and RL: ours packed, TRL's padded to the longest row), RLOO's loss aggregation details, the generation
code (ours: the native KV-cached engine; TRL: transformers.generate).

The same task and update is not the same arithmetic: our trainer skips work TRL does (`SHORTCUTS`: the output
layer only where the loss reads, a prompt held once per row, a group's prompt prefilled once) and routes its
products through the faster library. Both workers count what their model computes per step (`STEP_COUNTS`:
token slots, output-layer positions, micro steps), and `train_steps.py --waterfall` times our trainer with the
shortcuts switched on one by one beside TRL, so each ratio splits into its parts.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: real_model_memory's filler text
from real_model_memory import sentence  # noqa: E402

TASKS = ("sft", "dpo", "rl", "grpo")
RL_TASKS = ("rl", "grpo")  # rl: RLOO
DATASETS = ("filler", "arithmetic")  # real_model_memory's filler text (real models) | the demo's sums (toy)
REWARD_FUNCTIONS = {"filler": "peer.workload:vowel_share", "arithmetic": "aligner.demo.arithmetic:score_response"}

# Our trainer's shortcuts, in the order the waterfall switches them on (`waterfall`), and what each is.
SHORTCUTS = {
    "products": "the products through the library `cpu_products` prefers on this CPU, and the engine's decode "
                "on oneDNN-packed weights (off: torch's own products, BLAS, as TRL's)",
    "shared_prompts": "a prompt held once per packed row: a DPO pair's, an RL group's (off: once per sequence)",
    "shared_prefill": "a group's prompt prefilled once in generation (off: once per sample)",
    "logits_at_positions": "the output layer only at the positions the loss reads (off: every position)",
}
TASK_SHORTCUTS = {"sft": ("products", "logits_at_positions"),
                  "dpo": ("products", "shared_prompts", "logits_at_positions"),
                  "rl": tuple(SHORTCUTS), "grpo": tuple(SHORTCUTS)}
NO_SHORTCUTS = "none"
# What both workers count per step, for the training forwards (gradients on) and the other passes (reference,
# old logprobs; not generation): the token slots the model ran over (padding included), the positions its
# output layer ran at, and the training forwards (micro steps).
STEP_COUNTS = ("train_slots", "train_lm_positions", "train_micro_steps", "nograd_slots", "nograd_lm_positions")


def waterfall(task: str) -> tuple[str, ...]:
    """Our trainer's variants from no shortcut to all of the task's, one more switched on each time: "none",
    "products", "products+shared_prompts", ... (the last is our trainer as it runs)."""
    shortcuts = TASK_SHORTCUTS[task]
    return (NO_SHORTCUTS, *("+".join(shortcuts[:count]) for count in range(1, len(shortcuts) + 1)))


def shortcuts_of(variant: str) -> frozenset[str]:
    """The shortcuts a waterfall variant has on."""
    names = frozenset() if variant == NO_SHORTCUTS else frozenset(variant.split("+"))
    unknown = names - set(SHORTCUTS)
    if unknown:
        raise ValueError(f"variant {variant!r}: no shortcut {sorted(unknown)} (known: {', '.join(SHORTCUTS)})")
    return names


def flop_estimate(figures: dict[str, float]) -> float:
    """FLOPs of a step's counted forwards (`STEP_COUNTS`) from a worker's figures: 2 per parameter and token
    forward, 6 with the backward; the transformer layers at every slot, the output layer at its positions.
    Attention's score products and generation are left out (both sides' generated tokens are printed apart)."""
    body, head = figures["body_params"], figures["head_params"]
    return (6 * (body * figures["train_slots"] + head * figures["train_lm_positions"])
            + 2 * (body * figures["nograd_slots"] + head * figures["nograd_lm_positions"]))


@dataclass(frozen=True)
class Workload:
    task: str
    steps: int  # timed steps
    warmup_steps: int  # untimed steps first (allocations, first-call costs)
    global_batch_size: int  # SFT: sequences, DPO: pairs, RL: responses per optimizer step
    micro_batch_size: int  # per forward pass: sequences / pairs / responses
    max_seq_length: int  # SFT: every row truncated to it; DPO: prompt + longer answer
    threads: int = 2
    lr: float = 1e-6
    seed: int = 1234
    dpo_beta: float = 0.1
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    max_new_tokens: int = 32
    max_prompt_length: int = 128
    dataset: str = "filler"

    @property
    def reward_function(self) -> str:
        """"module:function" called fn(prompt, response_text) -> float, by our actor and (wrapped) by TRL."""
        return REWARD_FUNCTIONS[self.dataset]

    def __post_init__(self) -> None:
        # TRL generates one optimizer step's responses at a time (per-device batch x gradient accumulation)
        if self.task in RL_TASKS and self.rollouts_per_step != self.global_batch_size:
            raise ValueError(f"RL: {self.prompts_per_step} prompts x {self.samples_per_prompt} samples must equal the "
                             f"global batch {self.global_batch_size} (one optimizer step per rollout step)")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"micro batch {self.micro_batch_size} must divide the global batch "
                             f"{self.global_batch_size}")

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Workload":
        return cls(**json.loads(text))


def default_workload(task: str, steps: int, warmup_steps: int = 2, toy: bool = False) -> Workload:
    """The issue's sizes. SmolLM2: SFT micro batch 4 x 256 tokens; DPO 2 pairs up to 256 tokens; RL 8 prompts
    x 4 samples x 32 new tokens, all 32 responses one minibatch and one micro batch (ours packs a step's 32
    rollouts into one micro batch of packed rows whatever its micro batch size, so TRL's padded batch is 32 too:
    one training forward per step on each side). Toy (the demo's
    4-layer 128-wide model and arithmetic task): the demo's batches (SFT 128 x 32 tokens, DPO 64 pairs,
    RL 64 prompts x 4 samples x 6 new tokens in micro batches of 128)."""
    if task not in TASKS:
        raise ValueError(f"task {task!r}: choose from {TASKS}")
    if toy:
        sizes = {"sft": (128, 128, 32), "dpo": (64, 64, 32), "rl": (256, 128, 32), "grpo": (256, 128, 32)}[task]
        return Workload(task, steps, warmup_steps, *sizes, lr=1e-4, prompts_per_step=64, samples_per_prompt=4,
                        max_new_tokens=6, max_prompt_length=8, dataset="arithmetic")
    sizes = {"sft": (4, 4, 256), "dpo": (2, 2, 256), "rl": (32, 32, 256), "grpo": (32, 32, 256)}[task]
    return Workload(task, steps, warmup_steps, *sizes)


# ----------------------------------------------------------------------------- data (both sides read it)
def write_data(work: Workload, directory: Path) -> Path:
    """The task's JSONL, enough distinct records that no step repeats one; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    count = work.total_steps * (work.prompts_per_step if work.task in RL_TASKS else work.global_batch_size) + 8
    if work.dataset == "arithmetic":
        records = _arithmetic_records(work.task, count)
    elif work.task == "sft":  # > 256 tokens each: truncated to exactly max_seq_length on both sides
        records = [{"prompt": [{"role": "user", "content": sentence(i, 60)}],
                    "completion": [{"role": "assistant", "content": sentence(i + 100, 200)}]} for i in range(count)]
    elif work.task == "dpo":
        records = [{"prompt": [{"role": "user", "content": sentence(i, 40)}],
                    "chosen": [{"role": "assistant", "content": sentence(i + 200, 100)}],
                    "rejected": [{"role": "assistant", "content": sentence(i + 300, 90)}]} for i in range(count)]
    else:
        records = [{"prompt": [{"role": "user", "content": sentence(i, 12 + i % 8) + "?"}]} for i in range(count)]
    path = directory / f"{work.task}.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _arithmetic_records(task: str, count: int) -> list[dict]:
    """The demo's records (our venv only: the parent writes the data), in the conversational form."""
    from aligner.demo import arithmetic

    if task == "sft":
        return [{"prompt": [{"role": "user", "content": r["input"]}],
                 "completion": [{"role": "assistant", "content": r["output"]}]}
                for r in arithmetic.sft_records(count, seed=0)]
    if task == "dpo":
        return [{"prompt": [{"role": "user", "content": r["prompt"]}],
                 "chosen": [{"role": "assistant", "content": r["chosen"]}],
                 "rejected": [{"role": "assistant", "content": r["rejected"]}]}
                for r in arithmetic.preference_records(count, seed=0)]
    return [{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in arithmetic.rl_prompts(count, seed=0)]


def vowel_share(prompt, response: str) -> float:
    """The RL reward: the share of the response's letters that are vowels (cheap, deterministic)."""
    letters = [c for c in response.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


def trl_reward(function):
    """A `fn(prompt, response_text)` reward in TRL's form: lists in, lists out; conversational prompts and
    completions (lists of messages) become our prompt (the messages) and the reply's text."""
    def reward(prompts, completions, **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(function(prompt, text)) for prompt, text in zip(prompts, texts)]

    reward.__name__ = function.__name__  # TRL logs rewards under the function's name
    return reward


# ----------------------------------------------------------------------------- each side's settings
def aligner_overrides(work: Workload, checkpoint_dir: Path, data: Path, scratch: Path) -> tuple[str, list[str]]:
    """(conf yaml name, key=value overrides) for our trainer of `work.task`."""
    common = [f"model.init_from={checkpoint_dir}", "precision=fp32", f"seed={work.seed}",
              f"trainer.max_steps={work.total_steps}", f"trainer.global_batch_size={work.global_batch_size}",
              f"trainer.micro_batch_size={work.micro_batch_size}", "trainer.val_check_interval=0",
              f"optim.lr={work.lr}", f"optim.min_lr={work.lr}", "optim.warmup_steps=0", "optim.decay_style=constant",
              "optim.weight_decay=0.0", "optim.betas=[0.9,0.999]", "optim.eps=1.0e-8", "optim.clip_grad=1.0",
              "checkpoint.save_at_end=false", "checkpoint.save_interval=0", "checkpoint.resume=false",
              f"checkpoint.save_dir={scratch / 'checkpoints'}", f"logging.log_dir={scratch / 'logs'}",
              "logging.tensorboard=false", "logging.progress_bar=false", "logging.peak_tflops=1.0",
              f"logging.log_interval={work.total_steps + 1}"]
    if work.task == "sft":
        return "gpt_sft.yaml", [*common, f"data.train=[{{path: {data}, weight: 1.0}}]", "data.split='100,0'",
                                f"data.max_seq_length={work.max_seq_length}", "data.shuffle=false"]
    if work.task == "dpo":
        return "gpt_dpo.yaml", [*common, f"data.train=[{{path: {data}, weight: 1.0}}]", "data.split='100,0'",
                                f"data.max_seq_length={work.max_seq_length}", "data.shuffle=false",
                                f"dpo.beta={work.dpo_beta}", "dpo.reference_logprobs=swap"]
    return "gpt_reinforce_actor.yaml", [
        *common, f"data.prompts={data}", f"data.max_prompt_length={work.max_prompt_length}", "data.shuffle=false",
        f"advantage.estimator={'rloo' if work.task == 'rl' else 'grpo'}",
        f"rollout.prompts_per_step={work.prompts_per_step}",
        f"rollout.samples_per_prompt={work.samples_per_prompt}", f"generation.max_new_tokens={work.max_new_tokens}",
        f"generation.min_new_tokens={work.max_new_tokens}", "generation.temperature=1.0", "generation.top_k=0",
        "generation.top_p=1.0", f"generation.micro_batch_size={work.rollouts_per_step}", "generation.router=static",
        "kl.init_coef=0.0", "kl.adaptive=false", "loss.epochs=1", "loss.recompute_old_logprobs=true",
        "reward.source=function", f"reward.function={work.reward_function}", "logging.samples_interval=0"]


def trl_config(work: Workload, output_dir: Path) -> tuple[str, dict]:
    """(TRL trainer name, keyword arguments of its config class) for `work.task`."""
    common = dict(output_dir=str(output_dir), max_steps=work.total_steps, seed=work.seed, use_cpu=True, bf16=False,
                  fp16=False, gradient_checkpointing=False, learning_rate=work.lr, lr_scheduler_type="constant",
                  warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                  max_grad_norm=1.0, per_device_train_batch_size=work.micro_batch_size,
                  gradient_accumulation_steps=work.gradient_accumulation_steps, report_to="none",
                  save_strategy="no", eval_strategy="no", logging_steps=work.total_steps + 1, disable_tqdm=True,
                  dataloader_num_workers=0)
    if work.task == "sft":
        return "SFTTrainer", {**common, "max_length": work.max_seq_length, "packing": False, "padding_free": False,
                              "shuffle_dataset": False, "completion_only_loss": True, "assistant_only_loss": False}
    if work.task == "dpo":
        return "DPOTrainer", {**common, "max_length": work.max_seq_length, "beta": work.dpo_beta,
                              "precompute_ref_log_probs": False, "disable_dropout": True}
    rl = {**common, "num_generations": work.samples_per_prompt, "max_completion_length": work.max_new_tokens,
          "generation_kwargs": {"min_new_tokens": work.max_new_tokens}, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
          "beta": 0.0, "num_iterations": 1, "shuffle_dataset": False, "disable_dropout": True}
    if work.task == "rl":
        return "RLOOTrainer", rl
    # token_mean over the batch's response tokens as ours; rewards scaled by the group's std as our grpo
    return "GRPOTrainer", {**rl, "loss_type": "dapo", "scale_rewards": "group"}
