"""A character-level tokenizer for the demo task, saved as a Hugging Face tokenizer directory.

Every character is its own token (every digit one token, so the model sees the columns of a sum).
Ids: ``<pad>`` 0, ``<s>`` 1 (bos), ``</s>`` 2 (eos), ``<unk>`` 3, then the characters of the
training texts plus ``EXTRA_CHARACTERS`` in sorted order; any other character encodes to ``<unk>``.

Behaviour a data layer relies on:
- ``encode(text)`` / ``encode(text, add_special_tokens=True)`` adds *nothing*: there is no
  post-processor. The data layer adds bos/eos itself, so it controls exactly where they go.
- ``decode(ids, skip_special_tokens=True)`` round-trips text exactly: the decoder concatenates
  tokens (no spaces between characters) and ``clean_up_tokenization_spaces`` is off.
- The chat template (``CHAT_TEMPLATE``) renders messages plainly, compatible with task prompts:
  bos first, then a system message is its content plus a newline, a user message is its content
  as is, an assistant message is its content plus the eos token. A generation prompt adds
  nothing, since a task prompt ``"12+7="`` already ends where the answer starts. So
  ``[{"role": "user", "content": "12+7="}]`` renders to ``"<s>12+7="`` and with an assistant
  reply ``"19"`` to ``"<s>12+7=19</s>"``: a one-turn conversation is exactly the plain layout
  [bos] + prompt + answer + [eos], so every demo record (a text prompt is one user turn) has the
  same tokens with the template as without it.
- A tool message (a tool's answer in an agentic episode) is its content plus a newline, so
  ``[user "1234+5678=", assistant 'CALL calculate {"expression": "1234+5678"}', tool "6912",
  assistant "6912"]`` renders to ``'<s>1234+5678=CALL calculate {...}</s>6912\n6912</s>'``: the
  newline tells the model that the tool has answered and its own turn begins. The tools list a
  template may be given is not rendered (the toy model learns its one tool from demonstrations).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)  # ids 0, 1, 2, 3
# Always in the vocabulary: the chat template's system separator, and a space for free text.
EXTRA_CHARACTERS = ("\n", " ")
# Every printable ASCII character, for a vocabulary that must encode text the training data does not show: the
# agentic stage's tool calls (JSON) and the errors a tool environment answers a bad call with.
PRINTABLE_CHARACTERS = tuple(chr(code) for code in range(32, 127))

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}{{ message['content'] + eos_token }}"
    "{%- elif message['role'] == 'tool' -%}{{ message['content'] + '\\n' }}"
    "{%- else -%}{{ raise_exception('unsupported chat role ' + message['role']"
    " + '; expected system, user, assistant or tool') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def build_char_tokenizer(texts: Iterable[str], extra_characters: Iterable[str] = ()) -> "tokenizers.Tokenizer":  # noqa: F821
    """A ``tokenizers.Tokenizer`` with one token per character seen in ``texts`` (plus ``EXTRA_CHARACTERS`` and
    ``extra_characters``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    characters = set(EXTRA_CHARACTERS) | set(extra_characters)
    for text in texts:
        characters.update(text)
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for character in sorted(characters):
        vocab.setdefault(character, len(vocab))

    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # [\s\S] matches any character, newlines included: each becomes its own pre-token.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # concatenate tokens; the default would join with spaces
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def train_char_tokenizer(texts: Iterable[str], out_dir: str | Path, extra_characters: Iterable[str] = ()) -> None:
    """Build the character tokenizer over ``texts`` (and ``extra_characters``) and save it as an HF tokenizer
    directory (loadable with ``transformers.AutoTokenizer.from_pretrained(out_dir)``)."""
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_char_tokenizer(texts, extra_characters),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(str(out_dir))
