"""The recipes of aligner/conf/recipes/ on SmolLM2-135M-Instruct: a few steps of each, at its learning rate, move the
training loss (or the policy) and leave the general answers unbroken.

General answers: the greedy answer to "What is the capital of France?" still names Paris, and the KL from
the base's next-token distributions on held-out general prompts (their base greedy answers, teacher forced)
stays under GENERAL_KL_BOUND. Runs are cut to CPU size (sequences <= 128 tokens, micro batch 1-2, 2-3 steps);
the recipe's learning rate, schedule, adapters and method settings are what is tested.
"""
from __future__ import annotations

import math

import pytest
import torch

from aligner.config import CONF_DIR

from ..conftest import REPO_ROOT, metrics_rows, write_jsonl
from .conftest import run_python

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

GPT_EXAMPLES = REPO_ROOT / "examples" / "nlp" / "gpt"
RECIPES = CONF_DIR / "recipes"
CAPITAL = "What is the capital of France?"
GENERAL_PROMPTS = ("Name three colours.", "List three prime numbers.", "Give me two tips for a good night's sleep.")
ANSWER_TOKENS = 16
# Mean per-token KL(base || trained) on the general prompts' answers. Measured (fp32, CPU): the toy default lr
# 1e-4 with full weights gives 0.34 after the 3 SFT steps below; the recipes give SFT full 2.5e-2, SFT LoRA
# 2.0e-2, DPO full 7.8e-5, DPO LoRA 1.6e-2, GRPO full 1.4e-5, GRPO LoRA 3.1e-2.
GENERAL_KL_BOUND = 0.05
SMALL = ["trainer.val_check_interval=0", "checkpoint.save_interval=0", "logging.progress_bar=false",
         "logging.tensorboard=false", "logging.peak_tflops=1.0"]
SFT_RECORDS = [
    {"conversations": [{"from": "User", "value": "What is the colour of a ripe banana?"},
                       {"from": "Assistant", "value": "A ripe banana is yellow."}]},
    {"conversations": [{"from": "User", "value": "How many legs does a spider have?"},
                       {"from": "Assistant", "value": "A spider has eight legs."}]},
]
DPO_PAIRS = [
    {"prompt": [{"role": "user", "content": "What colour is a clear sky?"}],
     "chosen": "The sky is blue.", "rejected": "The sky is green."},
    {"prompt": [{"role": "user", "content": "Is fire hot or cold?"}],
     "chosen": "Fire is hot.", "rejected": "Fire is cold."},
]


def _prompt_tokens(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)[0]


def _evaluate(checkpoint, tokenizer, answers: list[list[int]] | None = None) -> dict:
    """In this process at TP=1: the greedy answer to CAPITAL, greedy answers to GENERAL_PROMPTS (if `answers`
    is None) and the log-probabilities [position, vocab] of each general prompt + answer (given or found)."""
    from aligner import checkpointing
    from aligner.models.forward import forward_logits
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
    from aligner.models.lora import load_for_inference
    from aligner.runtime import distributed, seeds

    def greedy(model, prompt: list[int]) -> list[int]:
        tokens = list(prompt)
        for _ in range(ANSWER_TOKENS):
            logits = forward_logits([model], torch.tensor([tokens]), cfg.vocab_size)
            tokens.append(int(logits[0, -1].argmax()))
            if tokens[-1] == tokenizer.eos_id:
                break
        return tokens[len(prompt):]

    distributed.initialize(distributed.ParallelConfig())
    try:
        seeds.set_seed(0)
        cfg = GPTConfig.from_dict(checkpointing.read_meta(checkpoint)["model"])
        model = build_gpt_model(cfg, transformer_config(cfg)).eval()
        load_for_inference(checkpoint, [model])  # an adapter checkpoint onto its base, live adapters
        with torch.no_grad():
            capital = tokenizer.decode(greedy(model, _prompt_tokens(tokenizer, CAPITAL)))
            prompts = [_prompt_tokens(tokenizer, text) for text in GENERAL_PROMPTS]
            answers = answers or [greedy(model, prompt) for prompt in prompts]
            logprobs = []
            for prompt, answer in zip(prompts, answers):
                logits = forward_logits([model], torch.tensor([prompt + answer]), cfg.vocab_size)[0]
                logprobs.append(torch.log_softmax(logits[len(prompt) - 1:-1].double(), -1))  # predicting the answer
    finally:
        distributed.shutdown()
    return {"capital": capital, "answers": answers, "logprobs": logprobs}


@pytest.fixture(scope="module")
def base_eval(smollm2_checkpoint):
    from aligner.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2_checkpoint / "tokenizer")
    result = _evaluate(smollm2_checkpoint, tokenizer)
    print(f"\n[recipes] base: {result['capital']!r}; general: "
          f"{[tokenizer.decode(answer) for answer in result['answers']]}")
    assert "Paris" in result["capital"]
    return tokenizer, result


def _general_kl(base: dict, trained: dict) -> float:
    """Mean over answer tokens of KL(base || trained) of the next-token distributions (float64)."""
    total, count = 0.0, 0
    for base_lp, trained_lp in zip(base["logprobs"], trained["logprobs"]):
        total += float((base_lp.exp() * (base_lp - trained_lp)).sum())
        count += base_lp.shape[0]
    return total / count


def _check_general_answers(name: str, checkpoint, base_eval) -> float:
    tokenizer, base = base_eval
    trained = _evaluate(checkpoint, tokenizer, base["answers"])
    kl = _general_kl(base, trained)
    print(f"[recipes] {name}: capital {trained['capital']!r}, KL to the base on general prompts {kl:.2e}")
    assert "Paris" in trained["capital"], (name, trained["capital"])
    assert kl < GENERAL_KL_BOUND, (name, kl)
    return kl


def _train(script: str, recipe: str, run_dir, *overrides: str) -> list[dict]:
    result = run_python(GPT_EXAMPLES / script, "--config", RECIPES / recipe, *overrides, *SMALL,
                        f"checkpoint.save_dir={run_dir / 'checkpoints'}", f"logging.log_dir={run_dir}")
    assert "known to work" not in result.stdout, result.stdout  # the recipe's lr is in lr_ranges' table
    return metrics_rows(run_dir, "train")


@pytest.mark.parametrize("recipe", ["smollm2_sft_full.yaml", "smollm2_sft_lora.yaml"])
def test_sft_recipe_learns_and_keeps_the_general_answers(recipe, smollm2_checkpoint, base_eval, tmp_path):
    from aligner.checkpointing import latest_checkpoint

    train = write_jsonl(tmp_path / "sft.jsonl", SFT_RECORDS)
    rows = _train("train_gpt_sft.py", recipe, tmp_path, f"model.init_from={smollm2_checkpoint}",
                  f"data.train=[{{path: {train}}}]", "data.split='100,0'", "data.max_seq_length=96",
                  "trainer.max_steps=3", "trainer.global_batch_size=2", "trainer.micro_batch_size=2")
    losses = [row["loss"] for row in rows]
    print(f"\n[recipes] {recipe} losses {losses}")
    assert len(losses) == 3 and losses[-1] < losses[0] * 0.98, losses  # both records each step: it learns them
    checkpoint = latest_checkpoint(tmp_path / "checkpoints")
    _check_general_answers(recipe, checkpoint, base_eval)
    if recipe.endswith("_lora.yaml"):
        _check_peft_export_loads_with_auto_peft(checkpoint, base_eval[0], tmp_path)


# The PEFT export's adapters run unmerged (x W + (x A) B, peft) and the merged export's folded (x (W + B A)):
# in fp32 the two roundings differ, and the difference grows through SmolLM2's 30 layers to logits of ~40.
# Measured after the LoRA SFT recipe's 3 steps: max |difference| 1.5e-4 with max |logit| 40.2, i.e. 3.7e-6 of
# it (tiny models: ~2e-7 with logits < 1, tests/unit/test_lora_export.py). A wrong adapter layout gives O(1).
PEFT_RELATIVE_TOLERANCE = 2e-5


def _check_peft_export_loads_with_auto_peft(checkpoint, tokenizer, tmp_path) -> None:
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    export = ("-m", "aligner.hf", "export", "--checkpoint", checkpoint, "--output")
    run_python(*export, tmp_path / "peft", "--lora", "peft")
    run_python(*export, tmp_path / "merged")
    tokens = torch.tensor([_prompt_tokens(tokenizer, CAPITAL) + _prompt_tokens(tokenizer, GENERAL_PROMPTS[0])])
    with torch.no_grad():
        adapted = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "peft").eval()(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(tokens).logits
    difference, scale = float((adapted - merged).abs().max()), float(merged.abs().max())
    print(f"[recipes] PEFT (AutoPeft) vs merged export: max |difference| {difference:.1e}, max |logit| {scale:.1f}, "
          f"relative {difference / scale:.1e}")
    assert difference < PEFT_RELATIVE_TOLERANCE * scale
    assert torch.equal(adapted.argmax(-1), merged.argmax(-1))


@pytest.mark.parametrize("recipe", ["smollm2_dpo_full.yaml", "smollm2_dpo_lora.yaml"])
def test_dpo_recipe_learns_and_keeps_the_general_answers(recipe, smollm2_checkpoint, base_eval, tmp_path):
    from aligner.checkpointing import latest_checkpoint

    train = write_jsonl(tmp_path / "pairs.jsonl", DPO_PAIRS)
    rows = _train("train_gpt_dpo.py", recipe, tmp_path, f"model.init_from={smollm2_checkpoint}",
                  f"data.train=[{{path: {train}}}]", "data.split='100,0'", "data.max_seq_length=64",
                  "trainer.max_steps=3", "trainer.global_batch_size=2", "trainer.micro_batch_size=2")
    losses = [row["preference_loss"] for row in rows]
    print(f"\n[recipes] {recipe} preference losses {losses}")
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference at step 1
    assert losses[-1] < math.log(2) - 1e-3, losses
    _check_general_answers(recipe, latest_checkpoint(tmp_path / "checkpoints"), base_eval)


@pytest.mark.parametrize("recipe", ["smollm2_grpo_full.yaml", "smollm2_grpo_lora.yaml"])
def test_grpo_recipe_moves_the_policy_and_keeps_the_general_answers(recipe, smollm2_checkpoint, base_eval,
                                                                     tmp_path):
    from aligner.checkpointing import latest_checkpoint
    from aligner.demo.instructions import prompt_records

    prompts = write_jsonl(tmp_path / "prompts.jsonl", prompt_records("train", 4, seed=0))
    rows = _train("train_gpt_reinforce_actor.py", recipe, tmp_path, f"model.init_from={smollm2_checkpoint}",
                  f"data.prompts={prompts}", "reward.function=aligner.demo.instructions:score_response",
                  "data.max_prompt_length=96", "generation.max_new_tokens=24", "rollout.prompts_per_step=2",
                  "generation.micro_batch_size=8", "trainer.max_steps=2", "trainer.global_batch_size=8",
                  "trainer.micro_batch_size=4")
    kl = [row["kl"] for row in rows]  # the rollouts' KL to the reference (the base)
    print(f"\n[recipes] {recipe} rollout KL to the base per step {kl}")
    assert len(kl) == 2 and kl[0] == 0.0 and kl[1] > 1e-3, kl  # the first update moved the policy
    _check_general_answers(recipe, latest_checkpoint(tmp_path / "checkpoints"), base_eval)
