"""The conversational encoder (aligner/data/conversation.py) on real chat templates and without one.

References: the chat template's own rendering tokenized in one piece by the HF tokenizer
(templated), the plain layout written out by hand (no template), and the SFT encoding of the same
conversation (what every reader must reproduce).
"""
from __future__ import annotations

import itertools

import pytest

from aligner.data.conversation import ChatEncoder, parse_answer, parse_prompt
from aligner.data.jsonl import DataError

from ..conftest import CHAT_KINDS, SAMPLE_ANSWERS, SAMPLE_PROMPTS, answer_text, sft_reference

TEMPLATED = ("smollm2", "llama3")
CASES = list(itertools.product(sorted(SAMPLE_PROMPTS), sorted(SAMPLE_ANSWERS)))


def _parsed(prompt_name: str, answer_name: str):
    record = {"prompt": SAMPLE_PROMPTS[prompt_name], "answer": SAMPLE_ANSWERS[answer_name]}
    return parse_prompt(record, "prompt", "t.jsonl", 1), parse_answer(record, "answer", "t.jsonl", 1)


@pytest.mark.parametrize("kind", TEMPLATED)
@pytest.mark.parametrize("prompt_name, answer_name", CASES)
def test_sample_is_the_template_rendering_up_to_the_end_of_turn_token(chat_tokenizers, kind, prompt_name, answer_name):
    tokenizer = chat_tokenizers[kind]
    prompt, answer = _parsed(prompt_name, answer_name)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    prompt_tokens, answer_tokens = ChatEncoder(tokenizer).sample_tokens(prompt, answer)

    hf = tokenizer.hf
    generation_prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    whole = hf.apply_chat_template(messages + [{"role": "assistant", "content": answer}], tokenize=False)
    end_of_turn = whole.index(hf.eos_token, len(generation_prompt)) + len(hf.eos_token)
    assert whole.startswith(generation_prompt)
    assert prompt_tokens == hf.encode(generation_prompt, add_special_tokens=False)
    assert prompt_tokens + answer_tokens == hf.encode(whole[:end_of_turn], add_special_tokens=False)
    assert answer_tokens[-1] == tokenizer.eos_id  # the reward is read here; generation stops here
    assert hf.decode(answer_tokens) == answer + hf.eos_token


@pytest.mark.parametrize("kind, use_template", [("plain", True), ("smollm2", False), ("llama3", False)])
@pytest.mark.parametrize("prompt_name, answer_name", CASES)
def test_without_a_template_the_plain_layout(chat_tokenizers, kind, use_template, prompt_name, answer_name):
    tokenizer = chat_tokenizers[kind]
    prompt, answer = _parsed(prompt_name, answer_name)
    prompt_tokens, answer_tokens = ChatEncoder(tokenizer, use_template=use_template).sample_tokens(prompt, answer)
    if isinstance(prompt, str):  # NeMo-Aligner's input/output layout
        expected_prompt = [tokenizer.bos_id] + tokenizer.encode(prompt)
    else:
        headers = {"system": "System: {}\n", "user": "User: {}\n"}
        expected_prompt = [tokenizer.bos_id]
        for message in prompt:
            if message["role"] == "assistant":
                expected_prompt += tokenizer.encode("Assistant: ") + tokenizer.encode(message["content"])
                expected_prompt += [tokenizer.eos_id]
            else:
                expected_prompt += tokenizer.encode(headers[message["role"]].format(message["content"]))
        expected_prompt += tokenizer.encode("Assistant: ")
    assert prompt_tokens == expected_prompt
    assert answer_tokens == tokenizer.encode(answer) + [tokenizer.eos_id]


@pytest.mark.parametrize("kind", CHAT_KINDS)
@pytest.mark.parametrize("use_template", [True, False])
@pytest.mark.parametrize("prompt_name, answer_name", CASES)
def test_prompt_plus_answer_is_the_sft_encoding_cut_at_the_answer(chat_tokenizers, kind, use_template, prompt_name,
                                                                  answer_name):
    tokenizer = chat_tokenizers[kind]
    prompt, answer = _parsed(prompt_name, answer_name)
    encoder = ChatEncoder(tokenizer, use_template=use_template)
    prompt_tokens, answer_tokens = encoder.sample_tokens(prompt, answer)
    tokens, answer_start = sft_reference(tokenizer, SAMPLE_PROMPTS[prompt_name], SAMPLE_ANSWERS[answer_name],
                                         use_template)
    assert prompt_tokens + answer_tokens == tokens
    assert len(prompt_tokens) == answer_start  # the answer is exactly what SFT puts loss on
    assert encoder.prompt_tokens(prompt) == prompt_tokens


@pytest.mark.parametrize("kind", TEMPLATED)
def test_a_text_prompt_is_one_user_turn_under_a_template(chat_tokenizers, kind):
    tokenizer = chat_tokenizers[kind]
    text = SAMPLE_PROMPTS["text"]
    assert ChatEncoder(tokenizer).prompt_tokens(text) == ChatEncoder(tokenizer).prompt_tokens(SAMPLE_PROMPTS["user"])
    assert ChatEncoder(tokenizer, use_template=False).prompt_tokens(text) == [tokenizer.bos_id] + tokenizer.encode(text)


USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": "hello"}


@pytest.mark.parametrize("record, key, message", [
    ({"prompt": [USER, ASSISTANT]}, "prompt", "'prompt' ends with an assistant turn"),
    ({"prompt": [{"role": "robot", "content": "x"}]}, "prompt", r"prompt\[0\] has unknown role 'robot'"),
    ({"prompt": [USER, {"role": "user"}]}, "prompt", r"prompt\[1\] needs string 'role' .*keys present: 'role'"),
    ({"prompt": []}, "prompt", "prompt is an empty list"),
    ({"prompt": " "}, "prompt", "key 'prompt' is empty"),
    ({"prompt": 3}, "prompt", "key 'prompt' is a int"),
    ({"answer": USER}, "answer", r"'answer' holds 1 message\(s\) \(user\); expected one assistant message"),
    ({"answer": [ASSISTANT, ASSISTANT]}, "answer", r"'answer' holds 2 message\(s\)"),
    ({"answer": ""}, "answer", "key 'answer' is empty"),
    ({"answer": {"role": "assistant", "content": " "}}, "answer",
     r"answer\[0\] is an assistant turn with empty content"),
    ({"other": "x"}, "answer", "missing key 'answer'"),
    # Empty turns are refused as an empty text prompt is; only a system turn may be empty.
    ({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": " "}]}, "prompt",
     r"prompt\[1\] is a user turn with empty content"),
    # An assistant turn before any user turn answers nothing (a template renders nothing before it).
    ({"prompt": [ASSISTANT, USER]}, "prompt", r"'prompt' opens with an assistant turn \(prompt\[0\]\); a "
                                              "conversation opens with a user turn"),
    ({"prompt": [{"role": "system", "content": "s"}, ASSISTANT, USER]}, "prompt",
     r"opens with an assistant turn \(prompt\[1\]\)"),
    # OpenAI content parts: text only.
    ({"prompt": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                              {"type": "image_url", "image_url": {"url": "x.png"}}]}]}, "prompt",
     r"prompt\[0\]\.content\[1\] is a 'image_url' part; expected text parts .*only"),
    ({"prompt": [{"role": "user", "content": ["hi"]}]}, "prompt", r"prompt\[0\]\.content\[0\] is a str; expected"),
])
def test_malformed_prompts_and_answers_name_file_line_and_key(record, key, message):
    parse = parse_prompt if key == "prompt" else parse_answer
    with pytest.raises(DataError, match=rf"^d\.jsonl:4: .*{message}"):
        parse(record, key, "d.jsonl", 4)


def test_text_content_parts_are_joined_and_a_system_turn_may_be_empty():
    """OpenAI's content-part lists: templates that take them print the text parts back to back."""
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "12+7?"}]
    record = {"prompt": [{"role": "system", "content": ""}, {"role": "user", "content": parts}],
              "answer": {"role": "assistant", "content": [{"type": "text", "text": "19"}]}}
    assert parse_prompt(record, "prompt", "d.jsonl", 1) == [{"role": "system", "content": ""},
                                                           {"role": "user", "content": "What is 12+7?"}]
    assert parse_answer(record, "answer", "d.jsonl", 1) == "19"


def test_answers_as_text_message_or_list_are_the_same_text():
    for value in ("19", {"role": "assistant", "content": "19"}, [{"from": "gpt", "value": "19"}]):
        assert parse_answer({"chosen": value}, "chosen", "d.jsonl", 1) == "19"
    assert answer_text(SAMPLE_ANSWERS["message_list"]) == "nineteen: 12+7=19"
