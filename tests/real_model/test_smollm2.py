"""SmolLM2-135M-Instruct end to end: a real pretrained chat model (30 layers, 9 query / 3 KV heads,
tied embeddings, ChatML template with a default system prompt), imported from its Q4_1 GGUF file.

References: transformers on the same dequantised weights (logits, greedy generation), a TP=1 run
(SFT at PP=2 and TP=3), the dequantised tensors themselves (export), log 2 (DPO's first step,
where the policy is the reference).
"""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from ..conftest import REPO_ROOT, metrics_rows, run_torchrun, write_jsonl
from ..gguf_files import logits_against_transformers
from .conftest import run_python

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

GPT_EXAMPLES = REPO_ROOT / "examples" / "nlp" / "gpt"
CONVERSATIONS = [
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi! Who are you?"},
     {"role": "assistant", "content": "I am SmolLM, an AI assistant."},
     {"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "List three prime numbers."}],
]
# fp32 through 30 layers in a different operation order (fused QKV and gate/up matmuls, megatron's
# RoPE and softmax): measured max |difference| 6.1e-5 with logits up to 42, i.e. ~1.5e-6 of their
# range. 5e-4 leaves room for other BLAS builds and is far below what a wrong layout gives (O(1)).
LOGIT_TOLERANCE = 5e-4
MAX_NEW_TOKENS = 24
# Loss differences between layouts come from fp32 reductions split across ranks: ~6e-7 relative at
# step 1 (forward only). Adam's first updates are ~lr * sign(gradient), so gradient entries near zero,
# whose sign the summation order decides, differ by ~2 lr: the step-2/3 differences grow with lr
# (measured 9e-6 at lr=1e-4, 2e-6 at the lr=1e-5 used below). A wrong gradient or a missing all-reduce
# changes them by > 1e-3.
LOSS_RELATIVE_TOLERANCE = 1e-5


def _hf_prompt(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


def test_import_logits_match_transformers_on_the_same_dequantised_weights(smollm2_checkpoint, smollm2_reference):
    from aligner.hf import read_hf_source
    from aligner.tokenizer import Tokenizer

    _, hf_tokenizer, hf_model, _ = smollm2_reference
    tokenizer = Tokenizer(smollm2_checkpoint / "tokenizer")
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size) == (1, 2, 2, 49152)
    prompts = [tokenizer.encode_chat(messages, add_generation_prompt=True)[0] for messages in CONVERSATIONS]
    assert prompts == [_hf_prompt(hf_tokenizer, messages) for messages in CONVERSATIONS]
    assert read_hf_source(smollm2_checkpoint)["dtype"] == "float32"

    logits, expected = logits_against_transformers(smollm2_checkpoint, hf_model, prompts, "SmolLM2")
    assert (logits - expected).abs().max().item() < LOGIT_TOLERANCE
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_chat_on_the_gguf_file_answers_like_transformers_generate(smollm2_gguf, smollm2_reference, tmp_path):
    """chat.py init_from=FILE.gguf (imported on the fly), batch mode on the native engine, greedy."""
    _, hf_tokenizer, hf_model, _ = smollm2_reference
    prompts_file = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": messages} for messages in CONVERSATIONS])
    output_file = tmp_path / "answers.jsonl"
    run_python(GPT_EXAMPLES / "chat.py", f"init_from={smollm2_gguf}", f"prompts_file={prompts_file}",
               f"output_file={output_file}", f"sampling.max_new_tokens={MAX_NEW_TOKENS}", "max_sequence_length=256",
               "batch_size=4")
    answers = [json.loads(line)["response"] for line in output_file.read_text().splitlines()]

    expected = []
    for messages in CONVERSATIONS:
        ids = torch.tensor([_hf_prompt(hf_tokenizer, messages)])
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=MAX_NEW_TOKENS, eos_token_id=2, pad_token_id=2)
        expected.append(hf_tokenizer.decode([t for t in out[0, ids.shape[1]:].tolist() if t != 2],
                                            skip_special_tokens=True))
    print(f"\n[real_model] answers: {answers}")
    assert answers == expected
    assert all(answer.strip() for answer in answers)


def test_sft_three_steps_at_pp2_and_tp3_equal_tp1(smollm2_checkpoint, tmp_path):
    """Conversational SFT (ChatML) from the imported checkpoint: the same losses at every layout."""
    records = [
        {"system": "You are a concise assistant.",
         "conversations": [{"from": "User", "value": "What is two plus two?"},
                           {"from": "Assistant", "value": "Two plus two is four."}]},
        {"conversations": [{"from": "User", "value": "Name a primary colour."},
                           {"from": "Assistant", "value": "Red is a primary colour."},
                           {"from": "User", "value": "Another one?"},
                           {"from": "Assistant", "value": "Blue."}]},
    ]
    train = write_jsonl(tmp_path / "sft.jsonl", records)
    # Both records in every step (global batch 2, micro batch 1): the loss must fall as they are learnt.
    common = [f"model.init_from={smollm2_checkpoint}", f"data.train=[{{path: {train}}}]", "data.split='100,0'",
              "data.max_seq_length=96", "trainer.max_steps=3", "trainer.global_batch_size=2",
              "trainer.micro_batch_size=1", "trainer.val_check_interval=0", "optim.lr=1e-5", "optim.warmup_steps=0",
              "optim.decay_style=constant", "checkpoint.save_at_end=false", "logging.progress_bar=false",
              "logging.tensorboard=false", "logging.peak_tflops=1.0"]
    losses = {}
    for tp, pp in ((1, 1), (1, 2), (3, 1)):
        run_dir = tmp_path / f"tp{tp}pp{pp}"
        run_torchrun(GPT_EXAMPLES / "train_gpt_sft.py", tp * pp, *common,
                     f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
                     f"checkpoint.save_dir={run_dir / 'ckpt'}", f"logging.log_dir={run_dir}")
        losses[(tp, pp)] = {row["step"]: row["loss"] for row in metrics_rows(run_dir, "train")}
    reference = losses[(1, 1)]
    print(f"\n[real_model] SFT losses: {losses}")
    assert sorted(reference) == [1, 2, 3]
    assert reference[3] < reference[1], f"loss did not fall: {reference}"
    for layout, layout_losses in losses.items():
        for step in (1, 2, 3):
            relative = abs(layout_losses[step] - reference[step]) / abs(reference[step])
            assert relative < LOSS_RELATIVE_TOLERANCE, (layout, step, layout_losses[step], reference[step])


def test_export_round_trip_is_bit_identical_to_the_dequantised_source(smollm2_checkpoint, smollm2_reference, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, hf_tokenizer, hf_model, dequantised = smollm2_reference
    export = tmp_path / "export"
    run_python("-m", "aligner.hf", "export", "--checkpoint", smollm2_checkpoint, "--output", export)
    exported = load_file(str(export / "model.safetensors"))
    assert sorted(exported) == sorted(dequantised)  # tied: no lm_head, as in the source
    for name, tensor in dequantised.items():
        assert exported[name].dtype == torch.float32 and torch.equal(exported[name], tensor), name

    reloaded = AutoModelForCausalLM.from_pretrained(str(export)).eval()
    tokens = torch.tensor([_hf_prompt(hf_tokenizer, CONVERSATIONS[1])])
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, hf_model(tokens).logits)
    # The tokenizer and chat template travel along.
    assert _hf_prompt(AutoTokenizer.from_pretrained(str(export)), CONVERSATIONS[1]) == tokens[0].tolist()


def test_dpo_first_step_on_conversational_pairs_is_log_2(smollm2_checkpoint, tmp_path):
    """Policy = reference at step 1, so every implicit reward is 0 and the DPO loss is log 2."""
    pairs = [
        {"prompt": [{"role": "system", "content": "Answer in one word."},
                    {"role": "user", "content": "What colour is a clear sky?"}],
         "chosen": {"role": "assistant", "content": "Blue."}, "rejected": "Green."},
        {"prompt": [{"role": "user", "content": "Is fire hot?"}],
         "chosen": "Yes.", "rejected": {"role": "assistant", "content": "No."}},
    ]
    train = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    run_dir = tmp_path / "dpo"
    result = run_python(GPT_EXAMPLES / "train_gpt_dpo.py", f"model.init_from={smollm2_checkpoint}",
               f"data.train=[{{path: {train}}}]", "data.split='100,0'", "data.max_seq_length=96",
               "trainer.max_steps=1", "trainer.global_batch_size=2", "trainer.micro_batch_size=1",
               "trainer.val_check_interval=0", "checkpoint.save_at_end=false", "logging.progress_bar=false",
               "logging.tensorboard=false", "logging.peak_tflops=1.0", f"checkpoint.save_dir={run_dir / 'ckpt'}",
               f"logging.log_dir={run_dir}")
    (first,) = metrics_rows(run_dir, "train")
    assert first["step"] == 1
    assert first["preference_loss"] == pytest.approx(math.log(2), abs=1e-6)
    # aligner/conf/gpt_dpo.yaml's toy lr on a real model: one warning line (aligner/training/lr_ranges.py)
    assert re.search(r"warning: optim.lr=0.0001 is 100x above the 1e-06 known to work for full-weight preference "
                     r"on a 13[45]M-parameter model \(.*\): it can wreck the model's general answers in a few steps; "
                     r"see aligner/conf/recipes/\n", result.stdout), result.stdout[-3000:]


def test_the_rl_default_max_prompt_length_takes_short_questions_under_the_default_system_prompt(smollm2_checkpoint,
                                                                                                 tmp_path):
    """SmolLM2's template renders its default system prompt (~30 tokens) into every prompt: the shipped
    data.max_prompt_length leaves room for a short question, and a limit that no prompt fits is one line
    naming the key and the shortest rendered length."""
    from aligner.config import CONF_DIR, composed_config
    from aligner.data.jsonl import DataError
    from aligner.generation.rollouts import PromptDataset
    from aligner.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2_checkpoint / "tokenizer")
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "What is 12+7?"}, {"prompt": CONVERSATIONS[2]}])
    for yaml_name in ("gpt_ppo_actor.yaml", "gpt_reinforce_actor.yaml"):
        default = composed_config(CONF_DIR / yaml_name).data.max_prompt_length  # set in the RL base yaml
        prompts = PromptDataset(path, tokenizer, default)
        assert len(prompts) == 2 and prompts.skipped_note == "", yaml_name
    shortest = min(len(tokens) for tokens in prompts.tokens)
    assert shortest > 30  # the default system prompt is in every rendering
    with pytest.raises(DataError, match=rf"^{path}: all 2 prompts are longer than data.max_prompt_length="
                                        rf"{shortest - 1} tokens as rendered .*at least {shortest}$"):
        PromptDataset(path, tokenizer, shortest - 1)
