"""`Tokenizer.encode` calls a fast tokenizer's Rust backend directly (a large data set's tokenizing pass was
mostly transformers' per-call Python): its ids must be exactly those of transformers' `encode`."""
from __future__ import annotations

import pytest

TEXTS = ["Hello world", " leading space", "What is the capital of France?", "a\nb\n\n  c", "", "  ", "12+7=19",
         "<|im_start|>user\nhi<|im_end|>", "<|begin_of_text|><|start_header_id|>user", "<s>x</s>", "émoji 🤖 ok",
         "List three prime numbers.\n", "\t tabs\tand  spaces "]


@pytest.mark.parametrize("kind", ["smollm2", "llama3", "plain"])
def test_encode_equals_transformers_encode(chat_tokenizers, kind):
    tokenizer = chat_tokenizers[kind]
    assert tokenizer._backend is not None  # the fast path is the one under test
    for text in TEXTS:
        assert tokenizer.encode(text) == tokenizer.hf.encode(text, add_special_tokens=False), text


def test_encode_of_the_character_tokenizer_equals_transformers_encode(arithmetic_tokenizer_dir):
    from aligner.tokenizer import Tokenizer

    tokenizer = Tokenizer(arithmetic_tokenizer_dir)
    for text in ["12+7=", "99+99=198", "", "0"]:
        assert tokenizer.encode(text) == tokenizer.hf.encode(text, add_special_tokens=False), text
