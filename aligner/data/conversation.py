"""Prompts and answers as every data file gives them, and the one way they become tokens.

A prompt is a string, or a list of {"role", "content"} messages (system, user, assistant and tool turns,
"from"/"value" and the roles human/gpt accepted as in NeMo-Aligner's SFT files; a user turn comes
before the first assistant turn, and the last turn is not the assistant's; content is text or
OpenAI's list of text parts). An answer is a string, an assistant message, or a one-message list
holding it (TRL's conversational layout).

`ChatEncoder` lays them out the same way for every algorithm, so a pair, a rollout and an SFT
example of the same conversation are the same tokens:
- with the tokenizer's chat template (unless `data.chat_template=false`): a string prompt is one
  user turn; the prompt's tokens are the template's rendering with the generation prompt; the
  answer's tokens are the reply and the end-of-turn token closing it, cut out of
  `Tokenizer.encode_chat` of the whole conversation. So prompt + answer is the SFT encoding of
  the conversation up to the end of the reply; what a template prints after it (ChatML's newline)
  is never generated, so it is not part of a sample.
- without one: a string prompt is [bos] + its tokens and an answer its tokens + [eos]
  (NeMo-Aligner's input/output layout); a message list takes the plain chat layout of
  `Tokenizer.encode_chat`.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Union

from jinja2.exceptions import TemplateError

from aligner.data.jsonl import DataError, require_key
from aligner.runtime.errors import ConfigError
from aligner.tokenizer import Tokenizer

# A tool turn (a tool's answer in an agent's conversation) is rendered by the chat template, never trained on; a
# template without a tool role refuses the record (`template_errors`).
ROLE_ALIASES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
                "tool": "tool"}

Prompt = Union[str, list]  # a string or a list of {"role", "content"} messages
Messages = list  # of {"role": ..., "content": ...}


def parse_messages(value: Any, what: str, path: str | Path, line: int) -> Messages:
    """Validate a list of turns into {"role", "content"} messages with canonical roles.

    A turn's content is text, or OpenAI's list of content parts, of which only text parts
    ({"type": "text", "text": ...}) are accepted, joined. User and assistant turns need non-blank
    text; a system turn may be empty (that is how a conversation drops a template's default system
    prompt, e.g. SmolLM2's).
    """
    if not isinstance(value, list) or not value:
        raise DataError(f"{path}:{line}: {what} is {'an empty list' if value == [] else 'a ' + type(value).__name__}; "
                        "expected a non-empty list of {\"role\", \"content\"} messages")
    messages = []
    for index, turn in enumerate(value):
        where = f"{what}[{index}]"
        if not isinstance(turn, dict):
            raise DataError(f"{path}:{line}: {where} is a {type(turn).__name__}; expected a JSON object")
        role_key = "role" if "role" in turn else "from"
        content_key = "content" if "content" in turn else "value"
        role_name, content = turn.get(role_key), turn.get(content_key)
        if isinstance(content, list):
            content = _text_of_parts(content, f"{where}.{content_key}", path, line)
        if not isinstance(role_name, str) or not isinstance(content, str):
            raise DataError(f"{path}:{line}: {where} needs string 'role' (or 'from') and 'content' (or 'value'); "
                            f"keys present: {', '.join(sorted(map(repr, turn))) or 'none'}")
        role = ROLE_ALIASES.get(role_name.strip().lower())
        if role is None:
            raise DataError(f"{path}:{line}: {where} has unknown role {role_name!r}; "
                            "expected system, user/human, assistant/gpt or tool")
        if role != "system" and not content.strip():
            raise DataError(f"{path}:{line}: {where} is a{'n' if role == 'assistant' else ''} {role} turn with empty "
                            "content; expected non-empty text (only a system turn may be empty)")
        messages.append({"role": role, "content": content})
    return messages


def _text_of_parts(parts: list, where: str, path: str | Path, line: int) -> str:
    """The text of an OpenAI-style content-part list. Chat templates that take part lists print the
    text parts back to back; templates that take only strings would print the list itself, so the
    parts are joined here, as those templates would render them."""
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            found = f"a {kind!r} part" if isinstance(kind, str) else f"a {type(part).__name__}"
            raise DataError(f"{path}:{line}: {where}[{index}] is {found}; expected text parts "
                            '{"type": "text", "text": ...} only (images, audio and files are not supported)')
    return "".join(part["text"] for part in parts)


def require_user_first(messages: Messages, what: str, path: str | Path, line: int) -> None:
    """Refuse a conversation whose first turn after any system turns is the assistant's: it has no
    question to answer (and a chat template would render nothing before it)."""
    first = next((index for index, message in enumerate(messages) if message["role"] != "system"), None)
    if first is not None and messages[first]["role"] == "assistant":
        raise DataError(f"{path}:{line}: {what!r} opens with an assistant turn ({what}[{first}]); a "
                        "conversation opens with a user turn (after any system turns), which the assistant answers")


def parse_prompt(record: dict, key: str, path: str | Path, line: int) -> Prompt:
    """record[key] as a prompt: non-blank text, or messages that end before an assistant reply."""
    value = require_key(record, key, path, line)
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{path}:{line}: key {key!r} is empty; expected non-empty text or messages")
        return value
    if isinstance(value, list):
        messages = parse_messages(value, key, path, line)
        if messages[-1]["role"] == "assistant":
            raise DataError(f"{path}:{line}: {key!r} ends with an assistant turn; a prompt ends with the turn "
                            "the answer replies to (put the reply under the answer's key)")
        require_user_first(messages, key, path, line)
        return messages
    raise DataError(f"{path}:{line}: key {key!r} is a {type(value).__name__}; "
                    "expected text or a list of {\"role\", \"content\"} messages")


def parse_answer(record: dict, key: str, path: str | Path, line: int) -> str:
    """record[key] as an answer's text: a string, an assistant message, or a list of one."""
    value = require_key(record, key, path, line)
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{path}:{line}: key {key!r} is empty; expected non-empty text or an assistant message")
        return value
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list):
        messages = parse_messages(value, key, path, line)
        if len(messages) != 1 or messages[0]["role"] != "assistant":
            raise DataError(f"{path}:{line}: {key!r} holds {len(messages)} message(s) "
                            f"({', '.join(m['role'] for m in messages)}); expected one assistant message")
        return messages[0]["content"]
    raise DataError(f"{path}:{line}: key {key!r} is a {type(value).__name__}; "
                    "expected text or an assistant message {\"role\": \"assistant\", \"content\": ...}")


@contextmanager
def template_errors(path: str | Path, line: int) -> Iterator[None]:
    """A chat template's complaint about one record (e.g. roles must alternate) as a DataError at path:line."""
    try:
        yield
    except DataError:
        raise
    except (ValueError, TemplateError) as error:
        raise DataError(f"{path}:{line}: cannot render the conversation with the chat template: {error}") from error


def prompt_text(prompt: Prompt) -> str:
    """A prompt as one string, for logs and progress lines (not for tokens)."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{message['role']}: {message['content']}" for message in prompt)


class ChatEncoder:
    """Tokens of prompts, answers and conversations for one tokenizer (see the module docstring).

    use_template: render with the tokenizer's chat template when it has one (`data.chat_template`).
    """

    def __init__(self, tokenizer: Tokenizer, use_template: bool = True):
        self.tokenizer = tokenizer
        self.templated = use_template and tokenizer.has_chat_template

    def messages(self, prompt: Prompt) -> Messages:
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    def _raw(self, prompt: Prompt) -> bool:
        """NeMo-Aligner's input/output layout: a string prompt without a template."""
        return isinstance(prompt, str) and not self.templated

    def prompt_tokens(self, prompt: Prompt) -> list[int]:
        """What the policy is given to answer: ends where the answer's first token goes."""
        if self._raw(prompt):
            bos = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
            return bos + self.tokenizer.encode(prompt)
        return self.tokenizer.encode_chat(self.messages(prompt), add_generation_prompt=True,
                                          use_template=self.templated)[0]

    def sample_tokens(self, prompt: Prompt, answer: str) -> tuple[list[int], list[int]]:
        """(prompt tokens, answer tokens): the answer's text and the end-of-turn token that closes it."""
        prompt_tokens = self.prompt_tokens(prompt)
        if self._raw(prompt):
            return prompt_tokens, self.tokenizer.encode(answer) + [self.tokenizer.eos_id]
        tokens, loss_mask = self.conversation_tokens(self.messages(prompt) + [{"role": "assistant", "content": answer}])
        end = max(index for index, masked in enumerate(loss_mask) if masked) + 1 if any(loss_mask) else 0
        if tokens[:len(prompt_tokens)] != prompt_tokens or end <= len(prompt_tokens) \
                or not all(loss_mask[len(prompt_tokens):end]):
            # encode_chat checks this for templates that re-render earlier turns; an empty reply
            # without an end-of-turn token is the other way to get here.
            raise ConfigError("the chat template does not render the answer as a continuation of the prompt's "
                              "generation prompt, so the answer's tokens cannot be cut out")
        return prompt_tokens, tokens[len(prompt_tokens):end]

    def conversation_tokens(self, messages: Messages) -> tuple[list[int], list[int]]:
        """(tokens, loss mask) of a whole conversation: the SFT encoding."""
        return self.tokenizer.encode_chat(messages, use_template=self.templated)

    def input_output_tokens(self, prompt: str, answer: str) -> tuple[list[int], list[int]]:
        """(tokens, loss mask) of an SFT {"input", "output"} record: a one-turn conversation."""
        if self._raw(prompt):
            prompt_tokens, answer_tokens = self.sample_tokens(prompt, answer)
            return prompt_tokens + answer_tokens, [0] * len(prompt_tokens) + [1] * len(answer_tokens)
        return self.conversation_tokens(self.messages(prompt) + [{"role": "assistant", "content": answer}])
