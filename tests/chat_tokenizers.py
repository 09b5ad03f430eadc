"""Tiny byte-level BPE tokenizers with the chat templates real models use, for tests.

Byte-level, so any text encodes and decodes back unchanged; trained in milliseconds on a few
sentences, with each template's special tokens added.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from aligner.tokenizer import Tokenizer

# SmolLM2-135M-Instruct's template (read from its GGUF file): ChatML with a default system prompt.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama-3-style: bos rendered by the template, headers, <|eot_id|> ends a turn, a default system message.
LLAMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>' }}{% endif %}"
    "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen2.5-style tools: the tools' JSON schemas in the system turn, tool results as user turns wrapped in
# <tool_response>, consecutive tool results in one turn; the model calls tools with <tool_call>{json}</tool_call>.
QWEN_TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nCall a function with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}{{ '\n</tools><|im_end|>\n' }}"
    "{% elif messages[0]['role'] == 'system' %}{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' + message['content'] + '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen3-style thinking: a reply's <think>...</think> block is dropped from replies before the last user turn,
# so a conversation is not the concatenation of its turns.
THINKING_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face.",
    "You are a helpful assistant. Answer briefly.",
    "What is the capital of France? The capital of France is Paris.",
    "List three prime numbers: 2, 3 and 5. Twelve plus seven is nineteen: 12+7=19.",
    "system user assistant hello world how are you fine thanks",
]

# name -> (template, bos, eos, pad, special tokens)
KINDS = {
    "smollm2": (SMOLLM2_TEMPLATE, "<|im_start|>", "<|im_end|>", "<|im_end|>", ["<|im_start|>", "<|im_end|>"]),
    "qwen_tools": (QWEN_TOOLS_TEMPLATE, None, "<|im_end|>", "<|endoftext|>",
                   ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]),
    "thinking": (THINKING_TEMPLATE, None, "<|im_end|>", "<|endoftext|>", ["<|endoftext|>", "<|im_start|>",
                                                                          "<|im_end|>"]),
    "llama3": (LLAMA3_STYLE_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>", "<|finetune_pad|>",
               ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|finetune_pad|>"]),
    "plain": (None, "<s>", "</s>", "<pad>", ["<s>", "</s>", "<pad>"]),
}


def build_chat_tokenizer(directory: str | Path, kind: str, template: Optional[str] = None) -> Tokenizer:
    """A tokenizer of `kind` (see KINDS) saved to `directory`; `template` overrides the kind's template."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    kind_template, bos, eos, pad, specials = KINDS[kind]
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(_CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=eos, pad_token=pad,
                                 clean_up_tokenization_spaces=False)
    hf.chat_template = template if template is not None else kind_template
    directory = Path(directory)
    hf.save_pretrained(str(directory))
    return Tokenizer(directory)
