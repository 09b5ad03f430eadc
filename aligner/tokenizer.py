"""A thin wrapper around a Hugging Face tokenizer read from a local directory.

Besides plain encode/decode it owns how a chat is laid out in tokens
(`encode_chat`), so that SFT training examples and the prompts given to the
policy at generation time are tokenized by the same code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from aligner.runtime.errors import ConfigError, DataError
from aligner.runtime.files import read_json

# Chat layout for tokenizers without a chat template: each segment is encoded
# on its own, the assistant reply is followed by eos, e.g.
#   <bos>System: {system}\nUser: {user}\nAssistant: {reply}<eos>User: ...
PLAIN_SYSTEM = "System: {content}\n"
PLAIN_USER = "User: {content}\n"
PLAIN_ASSISTANT_HEADER = "Assistant: "


class Tokenizer:
    """Token ids, special ids and chat layout of one HF tokenizer."""

    def __init__(self, directory: str | Path):
        path = Path(directory)
        if not path.is_dir():
            raise ConfigError(
                f"tokenizer directory {path} does not exist; expected a local directory with "
                "tokenizer files (tokenizer.json / tokenizer_config.json, e.g. written by save_pretrained)"
            )
        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as error:  # transformers and tokenizers raise many types for one damaged file
            raise _unreadable_tokenizer(path, error) from error
        self._init(hf_tokenizer, source=str(path))

    def _init(self, hf_tokenizer: PreTrainedTokenizerBase, source: str) -> None:
        self.hf = hf_tokenizer
        if hf_tokenizer.eos_token_id is None:
            # Every response we train on or generate ends with eos; without one nothing stops.
            raise DataError(f"tokenizer {source} has no eos token; set eos_token in its tokenizer_config.json")
        self.eos_id: int = hf_tokenizer.eos_token_id
        self.bos_id: int | None = hf_tokenizer.bos_token_id
        self.pad_id: int = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else self.eos_id
        self.vocab_size: int = len(hf_tokenizer)  # includes added tokens, unlike hf.vocab_size
        # A fast tokenizer's Rust backend directly: the ids transformers' `encode` returns (it calls the same
        # backend), without its ~30 us of Python per call, which dominate a large data set's tokenizing pass.
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without bos/eos."""
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False, *,
                    tools: Optional[list[dict]] = None, template: Optional[str] = None) -> str:
        """Text of `messages` ({"role", "content"} dicts) under the tokenizer's chat template (or `template`),
        with `tools` (JSON schemas) in the template's tools slot."""
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           tools=tools, chat_template=template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        """Token ids of a chat; with add_generation_prompt, ready for the assistant to reply."""
        return self.encode_chat(messages, add_generation_prompt)[0]

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = False,
                    use_template: bool = True, *, tools: Optional[list[dict]] = None,
                    template: Optional[str] = None) -> tuple[list[int], list[int]]:
        """Token ids of a chat and a same-length mask that is 1 on assistant replies.

        The mask covers each assistant message's content and the end-of-turn
        (or eos) token that closes it, i.e. what the model must learn to emit.
        Uses the chat template (`template`, else the tokenizer's) when there is one (and use_template), else the
        plain layout above; `tools` (JSON schemas) go to the template's tools slot.
        """
        if use_template and (template is not None or self.has_chat_template):
            return self._encode_templated_chat(messages, add_generation_prompt, tools, template)
        return self._encode_plain_chat(messages, add_generation_prompt)

    def _encode_templated_chat(self, messages: list[dict], add_generation_prompt: bool, tools: Optional[list[dict]],
                               template: Optional[str]) -> tuple[list[int], list[int]]:
        def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
            return self.render_chat(messages, add_generation_prompt, tools=tools, template=template)

        text = render_chat(messages, add_generation_prompt)
        # Character spans of each assistant reply, found by rendering prefixes of the chat:
        # the reply starts where "everything before + generation prompt" ends and ends
        # where "everything up to and including the reply" ends.
        cuts: list[int] = [0]
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = render_chat(messages[:index], add_generation_prompt=True)
            through = render_chat(messages[: index + 1])
            if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
                raise ConfigError(
                    "the chat template does not render a conversation as the concatenation of its turns "
                    f"(assistant turn {index} renders differently on its own), so assistant tokens cannot "
                    "be located; use a template that renders earlier turns unchanged"
                )
            # The newline a template may put after the end-of-turn token is never generated.
            end = len(through.rstrip())
            cuts += [len(before), max(end, len(before))]
        cuts.append(len(text))
        # Encode the pieces separately so the mask is exact and a training prompt is
        # tokenized exactly as the same prompt is at generation time.
        tokens: list[int] = []
        loss_mask: list[int] = []
        for piece_index, (start, end) in enumerate(zip(cuts[:-1], cuts[1:])):
            piece = self.encode(text[start:end]) if end > start else []
            tokens += piece
            loss_mask += [piece_index % 2] * len(piece)  # odd pieces are assistant replies
        return tokens, loss_mask

    def _encode_plain_chat(self, messages: list[dict], add_generation_prompt: bool) -> tuple[list[int], list[int]]:
        tokens: list[int] = [] if self.bos_id is None else [self.bos_id]
        loss_mask: list[int] = [0] * len(tokens)
        for message in messages:
            role, content = message["role"], message["content"]
            if role == "system":
                prompt, reply = self.encode(PLAIN_SYSTEM.format(content=content)), []
            elif role == "user":
                prompt, reply = self.encode(PLAIN_USER.format(content=content)), []
            elif role == "assistant":
                prompt, reply = self.encode(PLAIN_ASSISTANT_HEADER), self.encode(content) + [self.eos_id]
            else:
                raise DataError(f"unknown chat role {role!r}; expected system, user or assistant")
            tokens += prompt + reply
            loss_mask += [0] * len(prompt) + [1] * len(reply)
        if add_generation_prompt:
            header = self.encode(PLAIN_ASSISTANT_HEADER)
            tokens += header
            loss_mask += [0] * len(header)
        return tokens, loss_mask

    def save(self, directory: str | Path) -> None:
        """Write the tokenizer files so `Tokenizer(directory)` loads it back."""
        self.hf.save_pretrained(str(directory))


def _unreadable_tokenizer(directory: Path, error: Exception) -> DataError:
    """Which file of a tokenizer directory transformers could not read: a damaged JSON file by
    name and line, else the directory with transformers' own first line."""
    for path in sorted(directory.glob("*.json")):
        read_json(path)  # raises DataError naming the file and line
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return DataError(f"tokenizer directory {directory}: transformers cannot load it ({type(error).__name__}: {reason})")
